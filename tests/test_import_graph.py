"""No circles in llmaccel's imports, and no import up a layer: a file never imports one that (through any
chain) imports it, nor a module of a layer above its own (LAYERS, the house's floors, top to bottom).

The graph is grimp's (the engine of import-linter), over every import in the package: at the top of a
file, inside a function, and under TYPE_CHECKING (a type-only import is still a dependency of the
design)."""

from __future__ import annotations

import grimp

# The floors, top to bottom: a module may import its own floor and those below, never one above. A module
# belongs to the floor of the longest name that contains it (llmaccel.engine.engine is "the engine",
# llmaccel.engine.request "scheduling"); "llmaccel" alone is the package's __init__. A new module must fit
# a floor (test_every_module_has_a_floor); docs/layout.md draws the same floors.
LAYERS: list[tuple[str, list[str]]] = [
    ("the command line", ["llmaccel.cli"]),
    ("tuning", ["llmaccel.tune"]),
    ("benchmarks", ["llmaccel.bench"]),
    ("tools that drive the engine", ["llmaccel.distill", "llmaccel.cluster", "llmaccel.chat",
                                     "llmaccel.quantization.checkpoint", "llmaccel.quantization.perplexity",
                                     "llmaccel.quantization.awq", "llmaccel.safety.guard_train"]),
    ("the server", ["llmaccel.server"]),
    ("the Python API and the engine's thread", ["llmaccel", "llmaccel.llm", "llmaccel.engine.async_engine",
                                                "llmaccel.engine.engine_thread", "llmaccel.engine.request_stream"]),
    ("the engine", ["llmaccel.engine.engine", "llmaccel.engine.scoring", "llmaccel.engine.loading",
                    "llmaccel.engine.step_update", "llmaccel.safety.output_guard"]),
    ("a step", ["llmaccel.runner", "llmaccel.step_result", "llmaccel.batch_layout", "llmaccel.spec",
                "llmaccel.engine.guard_stage", "llmaccel.safety", "llmaccel.lora"]),
    ("scheduling and sampling", ["llmaccel.engine", "llmaccel.sampler"]),
    ("the model", ["llmaccel.model"]),
    ("kernels", ["llmaccel.ops"]),
    ("weight formats and data", ["llmaccel.quantization", "llmaccel.cache", "llmaccel.data", "llmaccel.wheel_data"]),
    ("settings", ["llmaccel.config", "llmaccel.config_file", "llmaccel.sampling_params", "llmaccel.outputs",
                  "llmaccel.engine_args"]),
    ("leaves", ["llmaccel.structured", "llmaccel.bounds", "llmaccel.errors", "llmaccel.platform",
                "llmaccel.logging_setup"]),
]


def floor_of(module: str, layers: list[tuple[str, list[str]]] = LAYERS) -> int | None:
    """The index of the module's floor in `layers` (0 the top), or None where no name contains it."""
    best: tuple[int, int] | None = None
    for floor, (_, names) in enumerate(layers):
        for name in names:
            contains = module == name or (name != "llmaccel" and module.startswith(name + "."))
            if contains and (best is None or len(name) > best[1]):
                best = (floor, len(name))
    return None if best is None else best[0]


def upward_imports(graph: grimp.ImportGraph, layers: list[tuple[str, list[str]]] = LAYERS) -> list[str]:
    """Every import of a module on a floor above the importer's, as 'importer (floor) -> imported (floor)'."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            low, high = floor_of(importer, layers), floor_of(imported, layers)
            if low is not None and high is not None and high < low:
                found.append(f"{importer} ({layers[low][0]}) -> {imported} ({layers[high][0]})")
    return found


def circles(graph: grimp.ImportGraph) -> list[frozenset[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm, iterative)."""
    edges = {module: sorted(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    graph = grimp.ImportGraph()
    for importer, imported in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")]:
        graph.add_import(importer=importer, imported=imported)
    assert circles(graph) == [frozenset({"a", "b", "c"})]


def test_no_circles_in_llmaccel():
    graph = grimp.build_graph("llmaccel", include_external_packages=False)
    found = [sorted(circle) for circle in circles(graph)]
    assert not found, f"import circles: {found} (move what both use down to a module below them)"


def test_the_floor_check_finds_an_import_up_and_allows_one_down():
    layers = [("top", ["pkg.top"]), ("bottom", ["pkg.low", "pkg"])]
    graph = grimp.ImportGraph()
    graph.add_import(importer="pkg.top.a", imported="pkg.low.b")  # down: allowed
    graph.add_import(importer="pkg.low.c", imported="pkg.low.b")  # same floor: allowed
    graph.add_import(importer="pkg.low.b", imported="pkg.top.d")  # up
    assert upward_imports(graph, layers) == ["pkg.low.b (bottom) -> pkg.top.d (top)"]
    assert floor_of("pkg.top.a.x", layers) == 0 and floor_of("elsewhere", layers) is None


def test_every_module_has_a_floor():
    graph = grimp.build_graph("llmaccel", include_external_packages=False)
    homeless = sorted(m for m in graph.modules if floor_of(m) is None)
    assert not homeless, f"modules on no floor: {homeless} (place them in LAYERS)"


def test_no_import_reaches_up_a_floor():
    graph = grimp.build_graph("llmaccel", include_external_packages=False)
    found = upward_imports(graph)
    assert not found, "imports up a floor (move the shared name down to a floor both can import):\n" + "\n".join(found)
