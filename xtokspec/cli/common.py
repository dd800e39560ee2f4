"""What the commands share: the help's format, the dtypes they take, the library's log on stderr, the
MIN-MAX option's parser, and the manifest a benchmark writes beside its results."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, except an empty one (None, False, []): their help says what happens instead."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class StderrHandler(logging.Handler):
    """The library's INFO messages (e.g. compiling a step) as '[xtokspec] ...' lines on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"[xtokspec] {record.getMessage()}", file=sys.stderr, flush=True)


def show_library_log() -> None:
    logger = logging.getLogger("xtokspec")
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        logger.addHandler(StderrHandler())
    logger.setLevel(logging.INFO)


def prompt_chars(text: str) -> tuple[int, int]:
    """--prompt-chars MIN-MAX (or N: exactly N characters)."""
    try:
        low, _, high = text.partition("-")
        span = (int(low), int(high or low))
        if 0 < span[0] <= span[1]:
            return span
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give MIN-MAX characters with 0 < MIN <= MAX (e.g. 8-24)")


MANIFEST = "manifest.json"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")  # what sets CPUs apart here


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of CPU_FLAGS it has (from /proc/cpuinfo; elsewhere what platform says)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    have = set(fields.get("flags", "").split())
    return fields.get("model name") or platform.processor() or "unknown CPU", [f for f in CPU_FLAGS if f in have]


def _commit(root: Path) -> str:
    """The checkout's commit, with '+changes' when tracked files differ from it ('unknown' outside git)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + (" +changes" if dirty else "")) if head else "unknown"


def manifest(command: str, device: str | None = None, root: Path | None = None, **extra) -> dict:
    """Where a result folder's figures come from: commit, machine (CPU and its flags, or the GPU), torch and
    transformers versions, the command and the date; `extra` (e.g. threads, vllm) is recorded as given."""
    import torch
    import transformers

    from .. import __version__

    cpu, flags = _cpu()
    machine = {"cpu": cpu, "cpu_flags": flags, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device and device.startswith("cuda") and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(torch.device(device))
    commit = _commit(root or Path(__file__).resolve().parents[2])  # the checkout xtokspec runs from
    if commit == "unknown":
        commit = f"unknown (xtokspec {__version__}, not run from a git checkout)"
    return {"commit": commit, "machine": machine, "torch": torch.__version__,
            "transformers": transformers.__version__, "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **extra}


def write_manifest(out: Path, command: str, device: str | None = None, **extra) -> Path:
    """OUT/manifest.json (see `manifest`), next to the results it describes; the folder is created if needed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / MANIFEST
    path.write_text(json.dumps(manifest(command, device, **extra), indent=1, ensure_ascii=False) + "\n")
    return path
