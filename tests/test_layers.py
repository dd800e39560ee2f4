"""The layer check (tests/check_layers.py) passes on the package and fails on an import that points up."""

import pathlib

from check_layers import package_sources, violations

ROOT = pathlib.Path(__file__).resolve().parent.parent / "xtokspec"


def test_the_package_imports_point_down_its_layers():
    assert violations(package_sources(ROOT)) == []


def test_an_upward_import_or_an_unplaced_module_is_reported():
    modules = package_sources(ROOT)
    modules["cache"] += "\n\ndef f():\n    from .loop import cycles\n"  # a lower layer reaching up, lazily
    modules["policy"] += "\nimport xtokspec.spec\n"
    modules["extra"] = "from . import types\n"
    problems = violations(modules)
    assert any(p.startswith("cache.py:") and "imports loop" in p for p in problems), problems
    assert any(p.startswith("policy.py:") and "imports spec" in p for p in problems), problems
    assert any(p.startswith("extra.py is in no layer") for p in problems), problems
    assert len(problems) == 3
