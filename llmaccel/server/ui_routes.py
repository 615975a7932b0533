"""`/ui`: the web page (llmaccel/server/ui/, static files shipped in the package), and the benchmark
result files it may list from `--ui-results-dir`.

The page itself carries no data, so it loads without a key; everything it shows comes from /v1/*
calls, which need the key like any other client's (the page asks for it).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse

from llmaccel.server import openapi
from llmaccel.server.errors import APIError

UI_DIR = Path(__file__).parent / "ui"
_STATIC = {"ui.js": "text/javascript", "ui.css": "text/css"}


def add_ui(app: FastAPI) -> None:
    @app.get("/ui", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((UI_DIR / "index.html").read_text(encoding="utf-8"),
                            headers={"Cache-Control": "no-cache"})

    @app.get("/ui/", include_in_schema=False)
    async def page_slash() -> RedirectResponse:
        return RedirectResponse("/ui")

    @app.get("/ui/static/{name}", include_in_schema=False)
    async def static(name: str) -> FileResponse:
        if name not in _STATIC:
            raise APIError(404, f"/ui/static/{name}: no such file", code="not_found")
        return FileResponse(UI_DIR / name, media_type=_STATIC[name], headers={"Cache-Control": "no-cache"})


def results_router(results_dir: str | None, dependencies: list) -> APIRouter:
    """GET /v1/llmaccel/results (the JSON files under the directory, by relative path; none without
    one) and GET /v1/llmaccel/results/{path} (one of them)."""
    router = APIRouter(prefix="/v1/llmaccel", dependencies=dependencies)
    root = Path(results_dir).expanduser().resolve() if results_dir else None

    def listing() -> list[str]:
        if root is None:
            return []
        return sorted(str(p.relative_to(root)) for p in root.rglob("*.json") if p.is_file())

    @router.get("/results")
    async def result_files() -> JSONResponse:
        return JSONResponse({"directory": str(root) if root else None, "files": listing()})

    @router.get("/results/{name:path}", responses=openapi.errors(404))
    async def result_file(name: str) -> FileResponse:
        if root is None:
            raise APIError(404, "this server has no results directory; start it with --ui-results-dir DIR",
                           code="not_found")
        try:
            path = (root / name).resolve()
            found = path.is_relative_to(root) and path.suffix == ".json" and path.is_file()
        except (ValueError, OSError):  # a NUL byte, a name too long
            found = False
        if not found:
            raise APIError(404, f"{name!r} is not a result file of {root}", param="name", code="not_found")
        return FileResponse(path, media_type="application/json")

    return router
