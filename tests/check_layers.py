"""Fail if a module of xtokspec imports one from a higher layer: the imports point one way, from the command line
down to plain data, between the packages and, inside each package, between its modules.

Packages (and the top-level modules), lowest first:

    types -> options, text, runtime -> decode -> spec, hf, vllm -> distill -> cli, __init__, __main__

Inside a package, lowest first (a package's __init__ sits on top of its own modules):

    text:     codec -> bridge, chat
    runtime:  kv, models, vocab -> compile -> cache
    decode:   sampling, keyed, policy -> tree, measures, stepcosts, rows -> mapping, propose -> protocols, verify -> loop -> assemble
    vllm:     settings, memory, requests, batch, cpu_sampling -> drafts, build -> drafting -> proposer
    distill:  data -> train, evaluate -> pipeline
    cli:      common, report, presets -> bench, distill_cmd -> main

A module may import from its own layer or any layer below it (lazy imports inside functions count too). A module
or package that is in no layer fails the check, so that a new one is placed on purpose."""

import ast
import pathlib
import sys

PACKAGES = [
    ("types",),
    ("options", "text", "runtime"),
    ("decode",),
    ("spec", "hf", "vllm"),
    ("distill",),
    ("cli", "__init__", "__main__"),
]
MODULES = {
    "text": [("codec",), ("bridge", "chat")],
    "runtime": [("kv", "models", "vocab"), ("compile",), ("cache",)],
    "decode": [("sampling", "keyed", "policy"), ("tree", "measures", "stepcosts", "rows"), ("mapping", "propose"), ("protocols", "verify"), ("loop",),
               ("assemble",)],
    "vllm": [("settings", "memory", "requests", "batch", "cpu_sampling"), ("drafts", "build"), ("drafting",), ("proposer",)],
    "distill": [("data",), ("train", "evaluate"), ("pipeline",)],
    "cli": [("common", "report", "presets"), ("bench", "distill_cmd"), ("main",)],
}
PACKAGE_LEVEL = {name: level for level, names in enumerate(PACKAGES) for name in names}
MODULE_LEVEL = {package: {name: level for level, names in enumerate(layers) for name in names}
                for package, layers in MODULES.items()}


def imported_modules(name: str, source: str, modules) -> list[tuple[int, str]]:
    """(line, module) for every import of an xtokspec module in `source`, the module `name` ("decode.loop",
    "spec", "vllm.__init__"); `modules`: every module's name, to tell a module from a name inside one."""
    package = name.split(".")[:-1]  # the importing module's package, as parts ([] at the top)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else None
            if base is None:
                found.append((node.lineno, "<outside xtokspec>"))
                continue
            head = base + (node.module.split(".") if node.module else [])
            targets = [head + [alias.name] for alias in node.names] if not node.module else [head]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xtokspec"):
            head = node.module.split(".")[1:]
            targets = [head + [alias.name] for alias in node.names] if not head else [head]
        elif isinstance(node, ast.Import):
            targets = [alias.name.split(".")[1:] for alias in node.names if alias.name.startswith("xtokspec")]
        else:
            continue
        found += [(node.lineno, resolve(parts, modules)) for parts in targets]
    return found


def resolve(parts: list[str], modules) -> str:
    """The module an import of `parts` reaches: the longest prefix that is a module, else that package's
    __init__ ("" parts: the top package's)."""
    for n in range(len(parts), 0, -1):
        dotted = ".".join(parts[:n])
        if dotted in modules:
            return dotted
        if f"{dotted}.__init__" in modules:
            return f"{dotted}.__init__"
    return "__init__"


def place(name: str) -> tuple[int | None, str | None, int | None]:
    """(package level, package, module level inside it) of a module; None where it has no place."""
    top, _, rest = name.partition(".")
    level = PACKAGE_LEVEL.get(top)
    if not rest:
        return level, None, None
    if rest == "__init__":  # a package's __init__ sits above its own modules
        return level, top, len(MODULES.get(top, ()))
    return level, top, MODULE_LEVEL.get(top, {}).get(rest)


def violations(modules: dict[str, str]) -> list[str]:
    """Problems in {module name ("decode.loop"): source}: imports of a higher layer, and modules in no layer."""
    problems = []
    for name in modules:
        level, package, inner = place(name)
        if level is None or (package is not None and inner is None):
            problems.append(f"{name.replace('.', '/')}.py is in no layer of {pathlib.Path(__file__).name}")
    for name, source in modules.items():
        level, package, inner = place(name)
        if level is None or (package is not None and inner is None):
            continue
        for line, imported in imported_modules(name, source, modules):
            where = f"{name.replace('.', '/')}.py:{line}"
            if imported == "<outside xtokspec>":
                problems.append(f"{where}: a relative import past the package's top")
                continue
            their_level, their_package, their_inner = place(imported)
            if their_level is None:
                continue  # named above as in no layer
            if their_level > level:
                problems.append(f"{where}: imports {imported} (package layer {their_level}) from layer {level}")
            elif package is not None and their_package == package and their_inner is not None and their_inner > inner:
                problems.append(f"{where}: imports {imported} (layer {their_inner} of {package}/) "
                                f"from layer {inner}")
    return problems


def package_sources(root: pathlib.Path) -> dict[str, str]:
    """{dotted module name below xtokspec ("decode.loop", "vllm.__init__"): source} for every .py file."""
    return {".".join(path.relative_to(root).with_suffix("").parts): path.read_text(encoding="utf-8")
            for path in sorted(root.rglob("*.py"))}


if __name__ == "__main__":
    root = pathlib.Path(__file__).resolve().parent.parent / "xtokspec"
    modules = package_sources(root)
    if not modules:
        sys.exit(f"no python files found under {root}")
    problems = violations(modules)
    packages = {name.split(".")[0] for name in modules if "." in name}
    print("\n".join(problems) or f"xtokspec/: {len(modules)} modules in {len(packages)} packages, every import "
          "points down its layers")
    sys.exit(1 if problems else 0)
