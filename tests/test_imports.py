"""Start-up: onnx-ir is imported without executing sympy, and sympy still works when used.

Each check runs in a fresh interpreter: the test process has sympy imported already (torch).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _run(code: str, *paths: Path) -> str:
    path = [str(p) for p in paths]
    prelude = f"import sys\nsys.path[:0] = {path!r}\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fusectl_imports_without_executing_sympy_and_sympy_works_after() -> None:
    out = _run(
        """
        import fusectl
        print("before", "sympy.core" in sys.modules)
        import onnx_ir as ir
        print("dim", ir.SymbolicDim("n") * 2 + 1)  # onnx-ir's own sympy use
        import sympy
        import sympy.stats  # a submodule sympy's __init__ does not import
        print("after", sympy.Max(2, 3), sympy.stats.Normal.__name__, type(sympy).__name__)
        print("same", sys.modules["sympy"] is sympy)
        """
    )
    assert out.splitlines() == [
        "before False",
        "dim 2*n + 1",
        "after 3 Normal module",
        "same True",
    ]


def test_optimizing_a_model_leaves_sympy_unexecuted() -> None:
    out = _run(
        """
        import fusectl
        result = fusectl.optimize("samples/models/tiny_cnn.onnx")
        print(len(result.model.graph), "sympy.core" in sys.modules)
        """
    )
    assert out.split() == ["5", "False"]


@pytest.fixture
def packages(tmp_path: Path) -> Path:
    """``dep`` (a package with a function, a class and a submodule), ``reads_function`` (keeps
    dep.f in a table at import, as onnx-ir does with sympy's functions) and ``subclasses``
    (derives from dep.Base at import: forwarders cannot serve that)."""
    (tmp_path / "dep").mkdir()
    (tmp_path / "dep" / "__init__.py").write_text(
        "print('dep executed')\nclass Base: pass\ndef f(x): return x + 1\n"
    )
    (tmp_path / "dep" / "sub.py").write_text("VALUE = 7\n")
    (tmp_path / "reads_function.py").write_text(
        "import dep\nTABLE = {'f': dep.f}\ndef use(x): return TABLE['f'](x)\n"
    )
    (tmp_path / "subclasses.py").write_text("import dep\nclass Mine(dep.Base): pass\n")
    return tmp_path


def test_a_function_read_at_import_forwards_to_the_module_executed_on_first_call(
    packages: Path,
) -> None:
    out = _run(
        """
        from fusectl._imports import import_deferring
        import_deferring("reads_function", deferred="dep")
        print("imported", "dep" in sys.modules)
        import reads_function
        print("call", reads_function.use(1))
        import dep.sub
        print("sub", dep.sub.VALUE, isinstance(reads_function.use, object))
        """,
        packages,
    )
    assert out.splitlines() == ["imported True", "dep executed", "call 2", "sub 7 True"]


def test_an_import_forwarders_cannot_serve_is_redone_with_the_module_executed(
    packages: Path,
) -> None:
    out = _run(
        """
        from fusectl._imports import import_deferring
        import_deferring("subclasses", deferred="dep")
        import dep, subclasses
        print(issubclass(subclasses.Mine, dep.Base), type(dep).__name__)
        """,
        packages,
    )
    assert out.splitlines() == ["dep executed", "True module"]


def test_nothing_is_deferred_when_the_module_is_executed_already(packages: Path) -> None:
    out = _run(
        """
        import dep
        from fusectl._imports import import_deferring
        import_deferring("reads_function", deferred="dep")
        import reads_function
        print(reads_function.TABLE["f"] is dep.f)
        """,
        packages,
    )
    assert out.splitlines() == ["dep executed", "True"]
