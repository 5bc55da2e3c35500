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
