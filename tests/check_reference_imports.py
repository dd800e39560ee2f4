"""Fail if anything under reference/ imports torch, transformers or xtokspec (reference must stand alone)."""

import ast
import pathlib
import sys

FORBIDDEN = {"torch", "transformers", "tokenizers", "xtokspec"}


def forbidden_imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    return found


if __name__ == "__main__":
    root = pathlib.Path(__file__).resolve().parent.parent / "reference"
    files = sorted(root.rglob("*.py"))
    if not files:
        sys.exit(f"no python files found under {root}")
    problems = [p for f in files for p in forbidden_imports(f)]
    print("\n".join(problems) or f"reference/ clean: {len(files)} files import only numpy/scipy/stdlib")
    sys.exit(1 if problems else 0)
