"""What the commands share: the help's format, the dtypes they take, the library's log on stderr, and the
MIN-MAX option's parser."""

from __future__ import annotations

import argparse
import logging
import sys

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
