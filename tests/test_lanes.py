"""The planner lane (``pytest -m "not slow and not process" tests/*.py``) stays torch-free,
so it runs in seconds: a test in ``tests/*.py`` that imports torch, transformers or the
runtime (which imports torch), itself or through a helper of its own file, is marked
``slow``. Read with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HEAVY = ("torch", "transformers", "moefit.runtime", "moefit.serve", "moefit.bench")


def _heavy_import(node: ast.AST) -> bool:
    """An import of a :data:`HEAVY` module, or ``pytest.importorskip`` of one."""
    def heavy(name: str) -> bool:
        return any(name == h or name.startswith(h + ".") for h in HEAVY)

    if isinstance(node, ast.Import):
        return any(heavy(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return heavy(node.module or "") or any(heavy(f"{node.module}.{a.name}") for a in node.names)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "importorskip" and node.args \
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return heavy(node.args[0].value)
    return False


def _marked_slow(decorators: list[ast.expr]) -> bool:
    for d in decorators:
        for n in ast.walk(d):
            if isinstance(n, ast.Attribute) and n.attr == "slow":
                return True
    return False


def unmarked_heavy_tests(source: str) -> list[str]:
    """Names of the test functions of ``source`` that reach a heavy import (directly or
    through the file's own functions) and are not marked ``slow`` (nor the module)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            if _marked_slow([node.value]):
                return []
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    calls = {name: {c.func.id for c in ast.walk(f) if isinstance(c, ast.Call)
                    and isinstance(c.func, ast.Name) and c.func.id in funcs}
             for name, f in funcs.items()}
    heavy = {name for name, f in funcs.items() if any(_heavy_import(n) for n in ast.walk(f))}
    grew = True
    while grew:
        more = {name for name, called in calls.items() if called & heavy} - heavy
        heavy |= more
        grew = bool(more)
    return sorted(name for name in heavy if name.startswith("test_")
                  and not _marked_slow(funcs[name].decorator_list))


def test_planner_lane_tests_import_no_torch():
    found = {p.name: bad for p in sorted(TESTS.glob("*.py"))
             if (bad := unmarked_heavy_tests(p.read_text()))}
    assert found == {}, f"mark these @pytest.mark.slow (they import torch / transformers): {found}"


def test_the_check_follows_helpers_and_sees_marks():
    src = textwrap.dedent("""
        import pytest

        def _meta():
            torch = pytest.importorskip("torch")

        def helper():
            return _meta()

        def test_direct():
            from transformers import AutoConfig

        def test_through_helpers():
            helper()

        @pytest.mark.slow
        def test_marked():
            helper()

        @pytest.mark.parametrize("x", [1])
        def test_light(x):
            import json
    """)
    assert unmarked_heavy_tests(src) == ["test_direct", "test_through_helpers"]
    assert unmarked_heavy_tests("import pytest\npytestmark = pytest.mark.slow\n" + src) == []
