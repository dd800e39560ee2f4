"""Fail if a module of xtokspec imports one from a higher layer: the imports point one way, from the command line
down to plain data.

    types -> sampling, codec, kv, compile, options -> tree, bridge, cache, models, chat -> mapping, policy, propose, batch_draft,
    request_table,
    verify -> loop -> spec, hf -> cli, bench, distill (distill_data, distill_train, distill_eval), report, vllm

A module may import from its own layer or any layer below it (lazy imports inside functions count too). A module
that is in no layer fails the check, so that a new one is placed on purpose."""

import ast
import pathlib
import sys

LAYERS = [
    ("types",),
    ("sampling", "codec", "kv", "compile", "options"),
    ("tree", "bridge", "cache", "models", "chat"),
    ("mapping", "policy", "propose", "verify", "batch_draft", "request_table"),
    ("loop",),
    ("spec", "hf"),
    ("cli", "bench", "distill", "distill_data", "distill_train", "distill_eval", "report", "vllm", "__init__", "__main__"),
]
LEVEL = {module: level for level, modules in enumerate(LAYERS) for module in modules}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, xtokspec module) for every import of a sibling module in `source` (a module of the package)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y / from . import x
            names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("xtokspec."):
            names = [node.module.split(".")[1]]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".")[1] for alias in node.names if alias.name.startswith("xtokspec.")]
        else:
            continue
        found += [(node.lineno, name) for name in names]
    return found


def violations(modules: dict[str, str]) -> list[str]:
    """Problems in {module name: source}: imports of a higher layer, and modules in no layer."""
    problems = [f"{name}.py is in no layer of {pathlib.Path(__file__).name}" for name in modules if name not in LEVEL]
    for name, source in modules.items():
        for line, imported in imported_modules(source):
            if name in LEVEL and LEVEL.get(imported, -1) > LEVEL[name]:
                problems.append(f"{name}.py:{line}: imports {imported} (layer {LEVEL[imported]}) from layer {LEVEL[name]}")
    return problems


def package_sources(root: pathlib.Path) -> dict[str, str]:
    return {path.stem: path.read_text(encoding="utf-8") for path in sorted(root.glob("*.py"))}


if __name__ == "__main__":
    root = pathlib.Path(__file__).resolve().parent.parent / "xtokspec"
    modules = package_sources(root)
    if not modules:
        sys.exit(f"no python files found under {root}")
    problems = violations(modules)
    print("\n".join(problems) or f"xtokspec/: {len(modules)} modules, every import points down its layers")
    sys.exit(1 if problems else 0)
