"""Every command BENCHMARKS.md quotes on a line of its own names an existing script whose arguments parse, and every
result folder it links to exists: a reader can rerun each table and find its data.

Commands are the indented (4-space) lines starting with `xtokspec`, `python benchmarks/` or `bash benchmarks/`;
`python` commands are parsed by the script's own parser: its `main()` runs with those arguments until argparse has
parsed them (nothing is measured); `xtokspec` ones by the command line's parser."""

from __future__ import annotations

import argparse
import re
import shlex
import sys

import pytest
from model_helpers import ROOT, load_script

TEXT = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
COMMANDS = [line.strip() for line in TEXT.splitlines()
            if line.startswith("    ") and line.strip().startswith(("xtokspec ", "python benchmarks/", "bash benchmarks/"))]
LINKS = sorted(set(re.findall(r"\]\((benchmarks/[^)\s]+)\)", TEXT)))


def test_the_document_quotes_commands_and_links_results():
    assert len(COMMANDS) >= 15, COMMANDS
    assert any(c.startswith("xtokspec bench") for c in COMMANDS)
    assert any(c.startswith("python benchmarks/vllm_bench.py") for c in COMMANDS)
    assert len(LINKS) >= 30, LINKS


class Parsed(Exception):
    """Raised by the patched parser once a script's arguments have parsed: the script stops before doing anything."""


def parse_only(original):
    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))
    return parse_args


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[:70])
def test_a_quoted_command_names_a_script_whose_arguments_parse(command, monkeypatch):
    words = shlex.split(command)
    if words[0] == "xtokspec":
        from xtokspec.cli.main import build_parser

        build_parser().parse_args(words[1:])
        return
    script = words[1]
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if words[0] == "bash":
        assert words[2].isdigit(), f"a gpu_run.sh part is a number: {command}"
        return
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as `python benchmarks/NAME.py` has it
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [script, *words[2:]])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only(argparse.ArgumentParser.parse_args))
    with pytest.raises(Parsed):  # NOTE: a bad argument exits with argparse's error (SystemExit 2) instead
        module.main()


@pytest.mark.parametrize("link", LINKS)
def test_a_linked_result_exists(link):
    assert (ROOT / link).exists(), f"BENCHMARKS.md links to {link}, which does not exist"


def test_every_study_folder_has_a_readme_and_a_manifest():
    results = ROOT / "benchmarks" / "results"
    studies = [p for machine in results.iterdir() if machine.is_dir() for p in machine.iterdir() if p.is_dir()]
    assert len(studies) >= 40, studies
    # a study's manifest sits beside its results: in the folder, or in each of its runs' subfolders
    missing = [str(p.relative_to(results)) for p in studies if not (p / "README.md").is_file()
               or not ((p / "manifest.json").is_file() or any(p.glob("*/manifest.json")))]
    assert not missing, f"study folders without README.md or manifest.json: {missing}"
