"""Every code block in README.md and docs/*.md runs as written.

Python blocks are executed (on the bundled fixture models), except those whose first line is a `# needs: ...`
comment (a model hub, a vLLM install): they are skipped with that reason shown. Shell blocks: every `xtokspec ...` command must
parse with the real command-line parser, and `xtokspec generate` commands run for real; the only other
commands allowed are the set-up ones (venv, pip, tox), which CI (`.ci/run` runs tox) and the fresh-venv
check exercise. A command of any other kind fails this test until it is covered here.
"""

from __future__ import annotations

import re
import shlex

import pytest
from model_helpers import ROOT, load_script

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [block for path in DOCUMENTS
          for block in re.findall(r"^```(\w+)\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)]
SETUP = (("python3", "-m", "venv"), ("python3", "-m", "pip", "install"), ("pip", "install"),
         (".venv/bin/pip", "install"), ("python3", "-m", "tox"), ("tox",))


def shell_commands() -> list[list[str]]:
    """Each simple command of the README's bash blocks (lines split at && and ;, comments dropped)."""
    commands = []
    for lang, body in BLOCKS:
        if lang not in ("bash", "sh", "console"):
            continue
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            current: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", ";"):
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(word)
    return commands


def test_readme_has_the_blocks_this_file_checks():
    langs = [lang for lang, _ in BLOCKS]
    assert "python" in langs and "bash" in langs, langs
    assert any(cmd[0].endswith("xtokspec") and cmd[1] == "generate" for cmd in shell_commands())


@pytest.mark.parametrize("command", shell_commands(), ids=lambda c: " ".join(c)[:60])
def test_shell_command_is_known_and_parses(command):
    if any(tuple(command[: len(s)]) == s for s in SETUP):
        if "-c" in command:  # a constraints file the command names must exist
            assert (ROOT / command[command.index("-c") + 1]).exists()
        return
    if command[0] in ("python", "python3") and command[1].startswith("benchmarks/"):
        load_script(command[1]).build_parser().parse_args(command[2:])  # a benchmark script's own options
        return
    assert command[0] in ("xtokspec", ".venv/bin/xtokspec"), f"README command not covered by this test: {command}"
    from xtokspec.cli.main import build_parser

    build_parser().parse_args(command[1:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [c for c in shell_commands() if c[0].endswith("xtokspec") and c[1] == "generate"],
    ids=lambda c: " ".join(c)[:60],
)
def test_generate_commands_run(command, capsys):
    from xtokspec.cli.main import main

    assert main(command[1:]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "stopped:" in err


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "python"])
def test_python_block_runs(index, capsys):
    first = BLOCKS[index][1].splitlines()[0]
    if first.startswith("# needs:"):
        pytest.skip(f"this block {first[2:]}")
    exec(compile(BLOCKS[index][1], f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
