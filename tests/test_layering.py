"""The packages import in one direction only: ffpa_jax -> tuning -> pallas_kernels, never
back (docs/design.md). Read from the source, so an import inside a function counts too."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each package, and the packages it must never import.
FORBIDDEN = {"pallas_kernels": {"tuning", "ffpa_jax"}, "tuning": {"ffpa_jax"}}


def imported_packages(path: pathlib.Path) -> set[str]:
    """Top-level package names the module imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_back_up(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & FORBIDDEN[package])
                 for f in files}
    assert not {f: names for f, names in offenders.items() if names}


def test_the_check_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from ffpa_jax import api\n    import tuning.lookup\n")
    assert imported_packages(module) == {"ffpa_jax", "tuning"}


# The house's measures (docs/design.md; issue 34): kernel and dispatch entry points take a
# record, not twenty keywords, and no product module grows past one screenful of concerns.
MAX_PARAMETERS = 10
MAX_MODULE_LINES = 600
PRODUCT_PACKAGES = ("ffpa_jax", "tuning", "pallas_kernels")


def parameter_counts(path: pathlib.Path) -> dict[str, int]:
    """name -> how many parameters each function of the module takes (*args and **kwargs
    count one each)."""
    counts = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            counts[node.name] = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                                 + (a.vararg is not None) + (a.kwarg is not None))
    return counts


@pytest.mark.parametrize("package", ["tuning", "pallas_kernels"])
def test_no_function_takes_more_than_ten_parameters(package):
    wide = {f"{f.relative_to(ROOT)}:{name}": n for f in sorted((ROOT / package).rglob("*.py"))
            for name, n in parameter_counts(f).items() if n > MAX_PARAMETERS}
    assert not wide


def test_the_parameter_count_sees_every_kind_of_parameter(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f(a, /, b, *c, d, e=1, **f):\n    pass\n")
    assert parameter_counts(module) == {"f": 6}


def test_no_product_module_is_over_600_lines():
    long = {str(f.relative_to(ROOT)): n for package in PRODUCT_PACKAGES
            for f in sorted((ROOT / package).rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long
