"""When and from which code a result file was written: its date (UTC) and the git commit of the checkout,
marked `+changes` where tracked files differed from it, so a figure in the docs can be traced to the code
that gave it. Outside a git checkout (an installed wheel) the commit is None."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str, cwd: Path = _ROOT) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None


def provenance() -> dict[str, str | None]:
    """{"date": "2026-12-05T06:38Z", "commit": "ea7d6a2" or "ea7d6a2+changes" or None}."""
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
    head = _git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0:
        return {"date": date, "commit": None}
    changed = _git("diff", "--quiet", "HEAD", "--", "llmaccel")
    dirty = changed is not None and changed.returncode == 1
    return {"date": date, "commit": head.stdout.strip() + ("+changes" if dirty else "")}


def added_in(path: Path) -> dict[str, str | None]:
    """For a result file written before files carried their provenance: the date and commit that added it
    to the repository (its figures come from the code just before), or Nones."""
    log = _git("log", "--diff-filter=A", "--format=%cs %h", "-1", "--", path.name, cwd=path.resolve().parent)
    if log is None or log.returncode != 0 or not log.stdout.strip():
        return {"date": None, "commit": None}
    date, commit = log.stdout.split()
    return {"date": date, "commit": commit}
