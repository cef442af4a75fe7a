"""The layers of the package import only downwards, and the array-API layers never import NumPy.

Every module of ``arraykv`` is parsed with :mod:`ast` (imports inside functions included) and
mapped to a layer:

0. base: ``_compat``, ``_types``, ``_validation``, ``protocol``
1. ``quant``, ``attention`` (attention may import quant, not the reverse)
2. ``ops``
3. ``storage``, ``compressor``
4. ``caches``
5. ``persist``, ``store``
6. ``integrations``: inside it ``integrations.common`` lies below the engine subpackages
   ``decoder``, ``onnxruntime`` and ``transformers``, which never import one another
   (:func:`test_integration_engines_import_no_other_engine`)
7. tools: ``eval``, ``inspect*``, ``cli*``, ``__main__``, ``data``

``arraykv/__init__.py`` may import anything; importing a name from it counts as layer 7. Modules of
layers 0 and 1 other than ``_compat`` never import NumPy (host-side tables come through ``_compat.host_numpy``).

No two modules import each other, directly or through others (:func:`test_no_import_circles`).
Every import counts, at module level or inside a function: an import deferred into a function
hides a circle from the interpreter but still ties the two modules together. A package's
``__init__`` is a module of its own; ``from pkg import name`` is an import of ``pkg.name`` when
that is a module, else of ``pkg``. Strings naming a module (the registries' ``"module:attr"``
targets) are not imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "arraykv"

LAYERS = {
    "_compat": 0,
    "_types": 0,
    "_validation": 0,
    "protocol": 0,
    "quant": 1,
    "attention": 1,
    "ops": 2,
    "storage": 3,
    "compressor": 3,
    "caches": 4,
    "persist": 5,
    "store": 5,
    "integrations": 6,
    "eval": 7,
    "data": 7,
    "__main__": 7,
    "compile_notice": 7,
}

#: Known violations in other layers' modules, each to be removed by that module's owner.
#: Entries are (importing module, imported module) as dotted names.
KNOWN_EXCEPTIONS: set = {}


def _layer(parts: tuple) -> int | None:
    top = parts[0]
    if top in LAYERS:
        return LAYERS[top]
    if top.startswith(("inspect", "cli")):
        return 7
    return None


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = tuple(p for p in rel.parts if p != "__init__")
        yield path, parts


def _imports(path: Path, parts: tuple):
    """``(imported dotted name, line)`` of every import in the module, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["arraykv", *parts] if is_pkg else ["arraykv", *parts[:-1]]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module is None or mod == "arraykv":  # from . import x: x may be a module
                for alias in node.names:
                    yield f"{mod}.{alias.name}", node.lineno
            else:
                yield mod, node.lineno
                for alias in node.names:  # from pkg import mod: also the submodule, where it is one
                    if f"{mod}.{alias.name}" in _MODULE_NAMES:
                        yield f"{mod}.{alias.name}", node.lineno


MODULES = list(_modules())
_MODULE_NAMES = {".".join(("arraykv", *parts)) for _, parts in MODULES}


def test_every_module_has_a_layer():
    missing = [".".join(p) for _, p in MODULES if p and _layer(p) is None]
    assert not missing, f"modules without a layer in tests/test_layering.py: {missing}"


@pytest.mark.parametrize(
    "path,parts", [(p, m) for p, m in MODULES if m], ids=lambda v: ".".join(v) if isinstance(v, tuple) else ""
)
def test_imports_go_to_the_same_or_a_lower_layer(path, parts):
    mine = _layer(parts)
    bad = []
    for name, line in _imports(path, parts):
        if not name.startswith("arraykv.") or name.startswith("arraykv.kernels"):
            continue
        target = tuple(name.split(".")[1:])
        theirs = _layer(target)
        if theirs is None:  # a name from the package root (the public API): as high as the tools
            theirs = 7
        pair = (".".join(("arraykv", *parts)), name)
        if pair in KNOWN_EXCEPTIONS:
            continue
        if theirs > mine or (mine == 1 and parts[0] == "quant" and target[0] == "attention"):
            bad.append(f"line {line}: {name} (layer {theirs})")
    assert not bad, f"{'.'.join(parts)} (layer {mine}) imports upwards: {bad}"


@pytest.mark.parametrize(
    "path,parts",
    [(p, m) for p, m in MODULES if m and _layer(m) in (0, 1) and m[0] != "_compat"],
    ids=lambda v: ".".join(v) if isinstance(v, tuple) else "",
)
def test_array_api_layers_never_import_numpy(path, parts):
    bad = [line for name, line in _imports(path, parts) if name == "numpy" or name.startswith("numpy.")]
    assert not bad, f"{'.'.join(parts)} imports numpy at lines {bad}"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import numpy as np\n    from ..ops import lookup\n")
    names = [n for n, _ in _imports(src, ("quant", "m"))]
    assert "numpy" in names and "arraykv.ops" in names


#: The engine subpackages of ``integrations``: siblings above ``integrations.common``.
ENGINES = ("decoder", "onnxruntime", "transformers")


def _engine_violations(path: Path, parts: tuple) -> list:
    """Imports of ``integrations`` modules that cross between engines, or go from ``common`` up to one."""
    if len(parts) < 2 or parts[0] != "integrations" or parts[1] not in (*ENGINES, "common"):
        return []
    mine = parts[1]
    bad = []
    for name, line in _imports(path, parts):
        target = name.split(".")
        if target[:2] != ["arraykv", "integrations"] or len(target) < 3:
            continue
        theirs = target[2]
        if theirs in ENGINES and theirs != mine:
            bad.append(f"line {line}: {name}")
    return bad


@pytest.mark.parametrize(
    "path,parts",
    [(p, m) for p, m in MODULES if m[:1] == ("integrations",) and len(m) > 1],
    ids=lambda v: ".".join(v) if isinstance(v, tuple) else "",
)
def test_integration_engines_import_no_other_engine(path, parts):
    bad = _engine_violations(path, parts)
    assert not bad, f"{'.'.join(parts)} imports another engine (or common imports an engine): {bad}"


def test_the_engine_check_sees_an_engine_importing_another(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..decoder.model import DecoderModel\n    from ..common import optional\n")
    assert _engine_violations(src, ("integrations", "onnxruntime", "m")) == [
        "line 2: arraykv.integrations.decoder.model"
    ]
    assert _engine_violations(src, ("integrations", "common", "m")) == ["line 2: arraykv.integrations.decoder.model"]
    assert _engine_violations(src, ("integrations", "decoder", "m")) == []


def _import_graph() -> dict:
    """``{module: {imported module: first line}}`` over the package's own modules."""
    graph: dict = {}
    for path, parts in MODULES:
        me = ".".join(("arraykv", *parts))
        out = graph.setdefault(me, {})
        for name, line in _imports(path, parts):
            while name and name not in _MODULE_NAMES:  # a name imported from a module: that module
                name = name.rpartition(".")[0]
            if name and name != me:
                out.setdefault(name, line)
    return graph


def _circles(graph: dict) -> list:
    """The import circles: strongly connected components of more than one module, each sorted."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    found: list = []

    def visit(v):  # Tarjan's algorithm; the graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    graph = _import_graph()
    report = []
    for comp in _circles(graph):
        edges = [f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in sorted(graph[a]) if b in comp]
        report.append(" <-> ".join(comp) + ": " + "; ".join(edges))
    assert not report, "import circles:\n" + "\n".join(report)


def test_the_circle_check_names_each_circle():
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 7}, "d": {"a": 2}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b": 1}, "b": {}}) == []


def test_the_import_graph_resolves_submodules_and_names(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from arraykv.caches import registry\nfrom ..ops.registry import lookup\n"
        "def f():\n    from .polar import PolarCache\n"
    )
    names = set(_imports(src, ("caches", "m")))
    assert ("arraykv.caches.registry", 1) in names and ("arraykv.ops.registry", 2) in names
    assert ("arraykv.caches.polar", 4) in names
