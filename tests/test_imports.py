"""The package's import graph, read with ``ast`` (nothing is imported).

Two rules over ``src/moefit/**.py``:

1. No import cycle between moefit's modules, counting both module-level imports and the
   imports inside functions (a function-local import is for a heavy dependency such as
   torch or FastAPI, never to dodge a cycle), and the ``__init__`` of every package an
   import passes through (importing ``a.b.c`` runs ``a/b/__init__.py`` first).
2. No module uses a private name (``_x``, not a dunder) of another module: neither
   ``from moefit.a import _x`` nor ``moefit.a._x`` / ``a._x`` through an imported module.
3. The layers of docs/design.md: a module imports only its own group and lower layers
   (:data:`LAYERS`).
4. A function-local import is for a heavy dependency (:data:`HEAVY`, or a module that
   imports one), for a package that needs an extra (:data:`EXTRAS`), for the modules a
   plan of moefit's own does not need (the other engines' models, the GGUF reader:
   :data:`ON_DEMAND`) or for a standard-library module that only a rare path uses and that
   would slow every plan down (:data:`RARE_STDLIB`), nothing else.

The first tests run the checks on the real package; the last ones on small made-up
packages, so that each check is seen to catch what it is for.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import moefit

SRC = Path(moefit.__file__).resolve().parent


@dataclass
class ImportGraph:
    """Modules of one package: ``edges[a]`` = {module b: line numbers where a imports b};
    ``private`` = (module, line, text) for each use of another module's private name."""

    modules: dict[str, Path]
    edges: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    private: list[tuple[str, int, str]] = field(default_factory=list)
    #: module -> moefit modules it imports at module level (not inside a function)
    top_level: dict[str, set[str]] = field(default_factory=dict)
    #: module -> top-level names of the outside packages it imports at module level
    outside: dict[str, set[str]] = field(default_factory=dict)
    #: (module, line, what) for each import inside a function: ``what`` is a moefit
    #: module or the top-level name of an outside package
    local: list[tuple[str, int, str]] = field(default_factory=list)


def _module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def read_graph(root: Path) -> ImportGraph:
    """The import graph of the package in directory ``root`` (its name is the package's)."""
    modules = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph = ImportGraph(modules)
    top = root.name
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = graph.edges.setdefault(name, {})
        bound: dict[str, str] = {}          # local name -> moefit module it refers to

        def target(module: str) -> str | None:
            while module and module not in modules:
                module = module.rpartition(".")[0]
            return module or None

        top_level = graph.top_level.setdefault(name, set())
        outside = graph.outside.setdefault(name, set())
        inside_function = {id(n) for f in ast.walk(tree)
                           if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                           for n in ast.walk(f) if n is not f}

        own_packages = {name.rsplit(".", n)[0] for n in range(1, name.count(".") + 1)}

        def add(module: str, node: ast.AST) -> None:
            t = target(module)
            if t is not None and t != name:
                edge(t, node)
                if id(node) in inside_function:
                    graph.local.append((name, node.lineno, t))
                # importing a.b.c runs a/b/__init__.py first: an edge to each package on
                # the way that is not one of the importer's own (those began running first)
                parts = t.split(".")
                for n in range(2, len(parts)):
                    pkg = ".".join(parts[:n])
                    if pkg in modules and pkg not in own_packages and pkg != name:
                        edge(pkg, node)

        def edge(t: str, node: ast.AST) -> None:
            edges.setdefault(t, []).append(node.lineno)
            if id(node) not in inside_function:
                top_level.add(t)

        def add_outside(module: str, node: ast.AST) -> None:
            if id(node) in inside_function:
                graph.local.append((name, node.lineno, module.split(".")[0]))
            else:
                outside.add(module.split(".")[0])

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == top:
                        add(alias.name, node)
                        if alias.asname:
                            bound[alias.asname] = alias.name
                    else:
                        add_outside(alias.name, node)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if module.split(".")[0] != top:
                    if module != "__future__":
                        add_outside(module, node)
                    continue
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    if sub in modules:                  # from pkg import module
                        add(sub, node)
                        bound[alias.asname or alias.name] = sub
                    else:
                        add(module, node)
                        if _is_private(alias.name) and target(module) != name:
                            graph.private.append((name, node.lineno,
                                                  f"from {module} import {alias.name}"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            dotted, base = [], node.value
            while isinstance(base, ast.Attribute):
                dotted.append(base.attr)
                base = base.value
            if not isinstance(base, ast.Name):
                continue
            ref = ".".join([bound.get(base.id, base.id), *reversed(dotted)])
            if ref in modules and ref != name:
                graph.private.append((name, node.lineno, f"{ref}.{node.attr}"))
    return graph


def find_cycle(edges: dict[str, dict[str, list[int]]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}            # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def _describe(graph: ImportGraph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph.edges[a][b][0]})" for a, b in zip(cycle, cycle[1:])) \
        + f" -> {cycle[-1]}"


# ---- the package --------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def package_graph() -> ImportGraph:
    """The import graph of ``src/moefit``, read once for the tests below (none changes it)."""
    return read_graph(SRC)


def test_the_package_has_no_import_cycle():
    graph = package_graph()
    assert len(graph.modules) > 40 and sum(map(len, graph.edges.values())) > 100
    cycle = find_cycle(graph.edges)
    assert cycle is None, "import cycle: " + _describe(graph, cycle)


#: Known uses awaiting their owner's change (module, text); empty now.
KNOWN_PRIVATE: set[tuple[str, str]] = set()


def test_no_module_uses_another_modules_private_names():
    graph = package_graph()
    new = [(m, line, text) for m, line, text in graph.private if (m, text) not in KNOWN_PRIVATE]
    assert new == [], "\n".join(f"{m}:{line}: {text}" for m, line, text in new)


def test_nothing_in_the_package_imports_the_command_line():
    graph = package_graph()
    importers = sorted(m for m, out in graph.edges.items() if "moefit.cli" in out)
    assert importers == ["moefit.__main__"]


#: Modules that start other programs (``moefit serve --engine llama.cpp`` runs llama-server):
#: only the command line imports them, so no plan or runtime path can start a process.
LAUNCHERS = ("moefit.external.llama_server",)


def test_only_the_command_line_imports_the_launchers():
    graph = package_graph()
    for launcher in LAUNCHERS:
        assert launcher in graph.modules
        importers = sorted(m for m, out in graph.edges.items() if launcher in out)
        assert importers == ["moefit.cli"], f"{launcher} imported by {importers}"
        assert launcher not in heavy_modules(graph)        # no torch: it runs without the serve extra


#: The layers of docs/design.md ("Layering"), lowest first: a module imports modules of its
#: own group or of a lower rank, never of a higher rank or of another group of its rank.
LAYERS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (0, "base", ("moefit", "moefit.units", "moefit.errors", "moefit.outputs", "moefit.records")),
    (1, "ingest", ("moefit.ingest",)),
    (2, "devices", ("moefit.devices",)),
    (3, "planner", ("moefit.memory", "moefit.plan")),
    (4, "external", ("moefit.external",)),
    (5, "flags", ("moefit.flags",)),
    # the runtime's rooms (docs/design.md), lowest first; its top modules rank above them
    (6, "runtime kernels", ("moefit.runtime.kernels",)),
    (6, "runtime arch", ("moefit.runtime.arch",)),
    (7, "runtime buffers", ("moefit.runtime.buffers",)),
    (7, "runtime weights", ("moefit.runtime.weights",)),
    (8, "runtime moe", ("moefit.runtime.moe",)),
    (9, "runtime layers", ("moefit.runtime.layers",)),
    (9, "runtime load", ("moefit.runtime.load",)),
    (10, "runtime", ("moefit.runtime",)),
    (11, "tools", ("moefit.tools",)),
    (11, "serve", ("moefit.serve",)),
    (11, "bench", ("moefit.bench",)),
    (12, "command line", ("moefit.cli", "moefit.__main__")),
)


def layer_of(module: str) -> tuple[int, str]:
    """(rank, group) of ``module``: the group whose longest prefix names it."""
    best = max(((len(p), rank, group) for rank, group, prefixes in LAYERS for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module}: in no layer of LAYERS; add it"
    return best[1], best[2]


def layer_violations(graph: ImportGraph) -> list[str]:
    out = []
    for a, targets in sorted(graph.edges.items()):
        rank_a, group_a = layer_of(a)
        for b, lines in sorted(targets.items()):
            rank_b, group_b = layer_of(b)
            if group_b != group_a and rank_b >= rank_a:
                out.append(f"{a}:{lines[0]} ({group_a}) imports {b} ({group_b})")
    return out


def test_each_layer_imports_only_the_layers_below():
    assert layer_violations(package_graph()) == []


#: What a function-local import may be for: a heavy or optional outside package, imported
#: only by the commands that need it (so that ``moefit plan`` stays torch-free and fast).
HEAVY = {"torch", "fastapi", "uvicorn", "anyio", "pydantic", "transformers", "tokenizers",
         "jinja2", "safetensors", "tqdm", "matplotlib", "gguf", "numpy", "pynvml", "psutil"}


#: Packages that need an extra (``serve``, ``bench``): the command line imports their
#: modules only once it has checked that the extra is installed.
EXTRAS = ("moefit.runtime", "moefit.serve", "moefit.bench", "moefit.tools")

#: Modules that a plan of a Hugging Face model (a preset) that fits does not use, imported
#: where their path begins so that ``moefit plan`` answers in under 0.1 s (issue 24): the
#: other engines' memory models (only ``moefit plan --engine``), the GGUF reader (headers and
#: their geometry) and llama-quantize's mix (only a .gguf model, ``--engine llama.cpp``, or a
#: plan that fails and prices a GGUF file as its remedy). tests/test_cli.py checks that a plan
#: loads none.
ON_DEMAND = ("moefit.external", "moefit.ingest.gguf_header", "moefit.ingest.gguf_reader",
             "moefit.ingest.gguf_mix")

#: Standard-library modules that a plan does not use and that cost it a millisecond or more
#: of CPU to import (``python -X importtime -m moefit plan ...``, 2026-12-01): imported only
#: on the path that needs them. hashlib loads OpenSSL's libcrypto (a calibration looked up
#: by its hash, only when calibration files exist); datetime stamps a calibration written;
#: tempfile (with random) writes files atomically; difflib finds the close names of an
#: unknown model; dataclasses (with the inspect, ast and dis it imports: 6-7 ms) only for the
#: dataclasses API used on a record (:mod:`moefit.records`) and a calibration's hash.
#: shutil (with zlib, bz2 and lzma: ~3 ms) only where files are copied or removed: argparse's
#: help formatter and the compiler lookup have their own few lines (moefit.cli._columns,
#: moefit.memory.cpu_kernels._which).
#: tests/test_cli.py checks that a plan loads none of them.
RARE_STDLIB = {"hashlib", "datetime", "tempfile", "difflib", "platform", "dataclasses", "shutil"}


def heavy_modules(graph: ImportGraph) -> set[str]:
    """moefit modules whose module-level imports (at any depth) reach a :data:`HEAVY`
    package."""
    heavy = {m for m, pkgs in graph.outside.items() if pkgs & HEAVY}
    grew = True
    while grew:
        more = {m for m, targets in graph.top_level.items() if targets & heavy} - heavy
        heavy |= more
        grew = bool(more)
    return heavy


def needless_local_imports(graph: ImportGraph) -> list[tuple[str, int, str]]:
    """Function-local imports of something that is neither heavy nor leads to it
    (:func:`heavy_modules`), nor a rarely needed standard-library module
    (:data:`RARE_STDLIB`), nor a module of a package that needs an extra imported from
    outside that package (:data:`EXTRAS`, :data:`ON_DEMAND`)."""
    heavy = heavy_modules(graph)

    def extra(m: str, what: str) -> bool:
        return any((what == p or what.startswith(p + ".")) and not m.startswith(p + ".")
                   for p in (*EXTRAS, *ON_DEMAND))

    return [(m, line, what) for m, line, what in graph.local
            if what not in heavy and what not in HEAVY and what not in RARE_STDLIB
            and not extra(m, what)]


#: Known ones awaiting their owner's change (module, what); empty now.
KNOWN_LOCAL: set[tuple[str, str]] = set()
#: Local by design (module, what): the entry point imports the command line after it has
#: installed its signal handlers (a signal during those 0.5 s of imports: one line, 130).
DEFERRED = {("moefit.__main__", "moefit.cli")}
#: Packages whose ``__init__`` re-exports its modules' names lazily (PEP 562 ``__getattr__``:
#: each module imported when one of its names is first read): llama.cpp's, whose failing-plan
#: alternative needs two of its six modules (issue 24).
LAZY_PACKAGES = {"moefit.external.llamacpp": ("buffers", "command", "host", "report", "solver", "split")}
DEFERRED |= {(pkg, f"{pkg}.{m}") for pkg, mods in LAZY_PACKAGES.items() for m in mods}


def test_function_local_imports_are_for_heavy_dependencies_only():
    graph = package_graph()
    assert "moefit.serve.app" in heavy_modules(graph)
    assert "moefit.plan.solver" not in heavy_modules(graph)
    new = [(m, line, what) for m, line, what in needless_local_imports(graph)
           if (m, what) not in KNOWN_LOCAL | DEFERRED]
    assert new == [], "import these at module level:\n" + "\n".join(
        f"{m}:{line}: {what}" for m, line, what in new)


# ---- the checks on made-up packages --------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "moefit"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_a_cycle_through_a_function_local_import_is_found(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from moefit.b import g\n",
        "sub/__init__.py": "",
        "b.py": "def g():\n    from moefit.sub import c\n",
        "sub/c.py": "from . import d\n",
        "sub/d.py": "import moefit.a as a\n",
    })
    graph = read_graph(root)
    assert find_cycle(graph.edges) == ["moefit.a", "moefit.b", "moefit.sub.c",
                                       "moefit.sub.d", "moefit.a"]
    (root / "sub" / "d.py").write_text("import moefit\n")
    assert find_cycle(read_graph(root).edges) is None


def test_a_cycle_through_a_parent_packages_init_is_found(tmp_path):
    """``ingest/probe.py`` imports ``ingest.families.common``, which runs
    ``families/__init__.py`` first; that imports ``families/dense.py``, which imports
    ``probe``: importing ``moefit.ingest.probe`` first raises ImportError. A module
    importing from its own package (``dense`` -> ``families.common``) is no cycle: its
    package's ``__init__`` runs before it."""
    root = _package(tmp_path, {
        "ingest/__init__.py": "",
        "ingest/probe.py": "from moefit.ingest.families.common import Cfg\nPROBE = 1\n",
        "ingest/families/__init__.py": "from moefit.ingest.families import dense\n",
        "ingest/families/common.py": "Cfg = object\n",
        "ingest/families/dense.py": "from moefit.ingest.families.common import Cfg\n"
                                    "from moefit.ingest.probe import PROBE\n",
    })
    graph = read_graph(root)
    assert find_cycle(graph.edges) == ["moefit.ingest.families", "moefit.ingest.families.dense",
                                       "moefit.ingest.probe", "moefit.ingest.families"]
    (root / "ingest" / "families" / "dense.py").write_text(
        "from moefit.ingest.families.common import Cfg\n")
    assert find_cycle(read_graph(root).edges) is None


def test_an_import_upwards_or_sideways_is_a_layer_violation(tmp_path):
    root = _package(tmp_path, {
        "units.py": "", "memory/__init__.py": "", "runtime/__init__.py": "",
        "serve/__init__.py": "", "bench/__init__.py": "",
        "memory/kv.py": "from moefit.units import x\nfrom moefit.runtime import y\n",
        "bench/ladder.py": "from moefit.serve import z\nfrom moefit.memory import kv\n",
    })
    assert layer_violations(read_graph(root)) == [
        "moefit.bench.ladder:1 (bench) imports moefit.serve (serve)",
        "moefit.memory.kv:2 (planner) imports moefit.runtime (runtime)"]


def test_every_runtime_room_has_a_rank():
    """Each sub-package of ``runtime/`` is a room with its own entry in :data:`LAYERS`, so
    that an import between two rooms is checked (a new room must be given a rank)."""
    rooms = sorted(f"moefit.runtime.{p.parent.name}" for p in (SRC / "runtime").glob("*/__init__.py"))
    assert len(rooms) >= 5
    named = {p for _, _, prefixes in LAYERS for p in prefixes}
    assert [r for r in rooms if r not in named] == []


def test_the_moe_layer_and_the_linear_product_sit_below_the_forward_pass():
    """The forward pass (``runtime/model.py``) takes its MoE layer from the moe room
    (``runtime/moe/layer.py``) and its linear products from the kernels room
    (``runtime/kernels/linear.py``), which the MoE layer multiplies through too: neither
    lives in ``model.py`` again, and the MoE layer ranks below the forward pass."""
    edges = package_graph().edges
    assert {"moefit.runtime.moe.layer", "moefit.runtime.kernels.linear"} <= set(edges["moefit.runtime.model"])
    assert "moefit.runtime.kernels.linear" in edges["moefit.runtime.moe.layer"]
    ranks = [layer_of(m)[0] for m in ("moefit.runtime.kernels.linear", "moefit.runtime.moe.layer",
                                      "moefit.runtime.model")]
    assert ranks == sorted(set(ranks)), ranks


def test_an_import_up_or_across_the_runtime_rooms_is_a_layer_violation(tmp_path):
    root = _package(tmp_path, {
        "runtime/__init__.py": "", "runtime/engine.py": "",
        "runtime/kernels/__init__.py": "", "runtime/moe/__init__.py": "",
        "runtime/layers/__init__.py": "", "runtime/load/__init__.py": "",
        "runtime/kernels/quant.py": "from moefit.runtime.moe import batch\n",
        "runtime/moe/batch.py": "from moefit.runtime.kernels import quant\n",
        "runtime/layers/attention.py": "from moefit.runtime.moe import batch\n"
                                       "from moefit.runtime.load import gguf\n",
        "runtime/load/gguf.py": "from moefit.runtime import engine\n",
    })
    assert layer_violations(read_graph(root)) == [
        "moefit.runtime.kernels.quant:1 (runtime kernels) imports moefit.runtime.moe (runtime moe)",
        "moefit.runtime.kernels.quant:1 (runtime kernels) imports moefit.runtime.moe.batch (runtime moe)",
        "moefit.runtime.layers.attention:2 (runtime layers) imports moefit.runtime.load (runtime load)",
        "moefit.runtime.layers.attention:2 (runtime layers) imports moefit.runtime.load.gguf (runtime load)",
        "moefit.runtime.load.gguf:1 (runtime load) imports moefit.runtime.engine (runtime)"]


def test_a_local_import_of_something_light_is_found(tmp_path):
    root = _package(tmp_path, {
        "units.py": "import math\n",
        "model.py": "import torch\n",
        "engine.py": "from moefit import model\n",
        "cli.py": "def run():\n    from moefit import engine\n    import numpy\n"
                  "    import json\n    from moefit.units import x\n",
    })
    graph = read_graph(root)
    assert heavy_modules(graph) == {"moefit.model", "moefit.engine"}
    assert needless_local_imports(graph) == [("moefit.cli", 4, "json"),
                                             ("moefit.cli", 5, "moefit.units")]


def test_private_names_of_other_modules_are_found(tmp_path):
    root = _package(tmp_path, {
        "a.py": "_hidden = 1\n__all__ = []\nx = _hidden\n",
        "b.py": "from moefit.a import _hidden, __all__\n",
        "c.py": "from moefit import a\ny = a._hidden\n",
        "d.py": "import moefit.a\nz = moefit.a._hidden + moefit.a.__all__\n",
        "e.py": "from moefit import a\nw = a.public\n",
    })
    found = sorted((m, text) for m, _, text in read_graph(root).private)
    assert found == [("moefit.b", "from moefit.a import _hidden"),
                     ("moefit.c", "moefit.a._hidden"), ("moefit.d", "moefit.a._hidden")]


def test_the_layout_names_every_module():
    """docs/layout.md's block names each module file (``arch.py``) of the package, but
    the family modules (a new family is one new file: the Layout says "one module per
    family")."""
    layout = (SRC.parents[1] / "docs" / "layout.md").read_text()
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    families = SRC / "ingest" / "families"
    files = {p.name for p in SRC.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
             and (p.parent != families or p.name in ("common.py", "registry.py"))}
    assert len(files) > 40
    missing = sorted(f for f in files if not re.search(rf"\b{re.escape(f)}", layout))
    assert missing == [], f"add to docs/layout.md: {missing}"


#: the longest a module may grow (lines): past it, split it by job (docs/layout.md)
MAX_MODULE_LINES = 640
#: the most Python files at the top of runtime/: the rest lives in its rooms
MAX_RUNTIME_TOP_FILES = 8


def test_no_module_is_longer_than_a_job():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these by job (over {MAX_MODULE_LINES} lines): {long}"


def test_the_top_of_runtime_holds_at_most_eight_files():
    top = sorted(p.name for p in (SRC / "runtime").glob("*.py"))
    assert len(top) <= MAX_RUNTIME_TOP_FILES, top


def test_a_lazy_package_reexports_what_it_did_and_loads_a_module_only_when_read():
    """``moefit.external.llamacpp`` (:data:`LAZY_PACKAGES`): importing it loads none of its
    modules; the solver's name loads the solver and what it imports, not the split, the
    report nor the GGUF header reader; every name of ``__all__`` is its module's."""
    import subprocess
    import sys

    import pytest

    code = textwrap.dedent("""
        import sys
        from moefit.external import llamacpp as lc
        def loaded():
            return sorted(m for m in sys.modules if m.startswith(("moefit.external.llamacpp.", "moefit.ingest.gguf_")))
        print(loaded())
        lc.solve_llamacpp
        print(loaded())
        lc.SCHEMA
        print(loaded())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(SRC.parent)})
    assert r.returncode == 0, r.stderr
    pkg = "moefit.external.llamacpp."
    solver = [pkg + m for m in ("buffers", "command", "host", "solver")] + ["moefit.ingest.gguf_mix"]
    assert r.stdout.splitlines() == ["[]", str(sorted(solver)), str(sorted(solver + [pkg + "report", pkg + "split"]))]   # the report shows split plans
    from moefit.external import llamacpp as lc
    for mod in LAZY_PACKAGES["moefit.external.llamacpp"]:
        module = __import__(pkg + mod, fromlist=["x"])
        for name in lc._HOMES[mod]:
            assert getattr(lc, name) is getattr(module, name)
    assert sorted(lc.__all__) == sorted(n for names in lc._HOMES.values() for n in names)
    with pytest.raises(AttributeError):
        lc.no_such_name
