"""No circles in llmaccel's imports: a file never imports one that (through any chain) imports it.

The graph is grimp's (the engine of import-linter), over every import in the package: at the top of a
file, inside a function, and under TYPE_CHECKING (a type-only import is still a dependency of the
design)."""

from __future__ import annotations

import grimp


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
