"""`xtokspec generate` on the bundled fixtures: the README's main-job command."""

from __future__ import annotations

import pytest

from xtokspec.cli import main


@pytest.mark.slow
def test_generate_prints_continuation_and_stats(capsys, ja_target):
    assert main(["generate", "自然言語処理とは何か", "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert out.strip(), "no continuation printed"
    assert "tokens/call" in err and "accepted" in err


@pytest.mark.slow
def test_stream_and_sampling_flags(capsys, ja_target):
    assert main(["generate", "設定ファイル", "--max-new-tokens", "16", "--stream", "--sample", "--seed", "3",
                 "--temperature", "0.8", "--top-k", "20"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and ("intersection" in err or "onehot" in err)


def test_bad_input_exits_2_with_a_message(capsys):
    assert main(["generate", "", "--max-new-tokens", "4"]) == 2
    assert "xtokspec: error: prompt is empty" in capsys.readouterr().err


def test_fetch_passes_its_own_options(capsys):
    """`xtokspec fetch --list` reaches the fetch tool's parser (argparse REMAINDER used to drop options)."""
    assert main(["fetch", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m"))
