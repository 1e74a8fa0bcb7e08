"""The import rules of the layers, read from their source (docs/design.md: arrows point down
only): compress/ imports nothing of cloudtrain but the native library `cloudtrain._C`, the core
imports none of the tools, and no import cycle runs inside either.

Every import statement counts, wherever it stands: at the top, inside a function (lazy) or under
`if TYPE_CHECKING:`, and `importlib.import_module("...")` with a literal name. `from .x import y`
is an edge to the module `x.y` where that is a module, else to `x`. Python's own import of a
module's parent packages is not an edge: a package's `__init__` imports its children, so counting
it would make every package a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cloudtrain
import cloudtrain.compress

PACKAGE = "cloudtrain.compress"
ROOT = Path(cloudtrain.compress.__file__).parent
CORE = Path(cloudtrain.__file__).parent  # cloudtrain/ (compress/ is a folder of its own)


def modules(package: str = PACKAGE, root: Path = ROOT) -> dict[str, Path]:
    """Every module of the layer by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def imports(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The dotted names the module `name` imports, anywhere in its source."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            base = ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            out.add(node.args[0].value)
    return out


def graph(package: str = PACKAGE, root: Path = ROOT) -> dict[str, set[str]]:
    found = modules(package, root)
    known = set(found)
    return {
        name: imports(name, path.read_text(), path.name == "__init__.py", known)
        for name, path in found.items()
    }


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the graph's own modules, as a path, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(edges[node] & edges.keys()):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_walk_sees_lazy_type_checking_and_importlib_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n"
        "    from .codecs import Codec\n"
        "def f():\n"
        "    from ..compress import packet\n"
        "    importlib.import_module('cloudtrain._C')\n"
    )
    known = {f"{PACKAGE}.codecs", f"{PACKAGE}.packet"}
    found = imports(f"{PACKAGE}.zstd", source, False, known)
    assert found >= {f"{PACKAGE}.codecs", f"{PACKAGE}.packet", "cloudtrain._C"}
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_compress_imports_nothing_of_cloudtrain_but_its_native_library():
    edges = graph()
    assert "cloudtrain._C" in edges[f"{PACKAGE}.ops"], "the walk must see the native load"
    upward = {
        (name, target)
        for name, targets in edges.items()
        for target in targets
        if target.split(".")[0] == "cloudtrain"
        and target != "cloudtrain._C"
        and not target.startswith(PACKAGE)
    }
    assert not upward, f"compress/ imports the layers above it: {sorted(upward)}"


def test_compress_import_graph_has_no_cycle():
    edges = graph()
    assert f"{PACKAGE}.packet" in edges[f"{PACKAGE}.codecs.base"], "the walk must see `from ..`"
    assert not any(t.startswith(f"{PACKAGE}.codecs") for t in edges[f"{PACKAGE}.packet"]), (
        "the wire format must not know the codec library (it reads codecs as packet.WireCodec)"
    )
    assert cycle(edges) is None, f"import cycle in compress/: {' -> '.join(cycle(edges) or [])}"


def test_the_core_imports_no_tool_and_has_no_import_cycle():
    edges = graph("cloudtrain", CORE)
    assert "cloudtrain.controller" in edges["cloudtrain.hook"], "the walk must see the lazy import"
    core = {name for name in edges if not name.startswith("cloudtrain.tools")}
    upward = {
        (name, target)
        for name in core
        for target in edges[name]
        if target.startswith("cloudtrain.tools")
    }
    assert not upward, f"the core imports the tools: {sorted(upward)}"
    assert cycle(edges) is None, f"import cycle in cloudtrain/: {' -> '.join(cycle(edges) or [])}"
