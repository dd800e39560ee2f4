"""The layer check (tests/check_layers.py) passes on the package and fails on an import that points up, between
packages or inside one."""

import pathlib

from check_layers import package_sources, violations

ROOT = pathlib.Path(__file__).resolve().parent.parent / "xtokspec"


def test_the_package_imports_point_down_its_layers():
    assert violations(package_sources(ROOT)) == []


def test_an_upward_import_or_an_unplaced_module_is_reported():
    modules = package_sources(ROOT)
    modules["runtime.cache"] += "\n\ndef f():\n    from ..decode.loop import cycles\n"  # a lower package, lazily
    modules["decode.policy"] += "\nimport xtokspec.spec\n"  # up to the facade, absolute
    modules["decode.sampling"] += "\nfrom .loop import cycles\n"  # up inside its own package
    modules["text.codec"] += "\nfrom . import bridge\n"  # the same, by module name
    modules["extra"] = "from . import types\n"
    modules["decode.extra"] = "from . import sampling\n"
    problems = violations(modules)
    assert any(p.startswith("runtime/cache.py:") and "imports decode.loop" in p for p in problems), problems
    assert any(p.startswith("decode/policy.py:") and "imports spec" in p for p in problems), problems
    assert any(p.startswith("decode/sampling.py:") and "imports decode.loop (layer" in p for p in problems), problems
    assert any(p.startswith("text/codec.py:") and "imports text.bridge (layer" in p for p in problems), problems
    assert any(p.startswith("extra.py is in no layer") for p in problems), problems
    assert any(p.startswith("decode/extra.py is in no layer") for p in problems), problems
    assert len(problems) == 6
