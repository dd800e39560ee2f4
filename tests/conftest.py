"""Shared fixtures. Imports nothing heavy at module level: the `reference` tox env (no torch) loads this file."""

from __future__ import annotations

import pathlib
import sys

import pytest
from model_helpers import FIXTURES, load_fixture_model, load_tokenizer, tiny_llama, tiny_neox

# `reference` (the NumPy oracle) is not installed with xtokspec: it is read from the source tree. Appended, so
# that the installed xtokspec (tox builds a wheel) still comes before the source tree's copy.
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))


def pytest_configure(config):
    """One torch thread: the fixture models are tiny, and on a shared 2-core machine a 2-thread op stalls
    whenever its peer thread is descheduled (measured: 8 ms per tiny matmul under load instead of ~0.05)."""
    try:
        import torch
    except ImportError:  # the reference env has no torch
        return
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _draft_every_cycle(request, monkeypatch):
    """The fallback to the target alone (SpecConfig.fallback) is chosen from wall-clock timings, so on a loaded
    test machine it would change which cycles draft from run to run, and with them the paths and counts the
    tests check. Tests therefore draft every cycle, through the policy seam `XTokSpec.fallback_policy`, except
    those marked `fallback` (tests/test_fallback.py and the alternation chi-square test), which drive or check
    the choice itself."""
    if request.node.get_closest_marker("fallback"):
        return
    try:
        from policies import always_draft

        from xtokspec import XTokSpec
    except ImportError:  # the reference env has no torch
        return
    monkeypatch.setattr(XTokSpec, "fallback_policy", staticmethod(always_draft))


@pytest.fixture(scope="session")
def sp_tokenizer():
    """ja-sp: SentencePiece unigram with byte fallback and BOS (the llm-jp kind)."""
    return load_tokenizer(FIXTURES / "tokenizers" / "ja-sp")


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """ja-bpe: byte-level BPE without BOS (the open-calm kind)."""
    return load_tokenizer(FIXTURES / "tokenizers" / "ja-bpe")


@pytest.fixture(scope="session")
def ja_target():
    return load_fixture_model("ja-target")


@pytest.fixture(scope="session")
def ja_draft_bpe():
    return load_fixture_model("ja-draft-bpe")


@pytest.fixture(scope="session")
def ja_draft_same():
    return load_fixture_model("ja-draft-same")


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    lines = (FIXTURES / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line]


@pytest.fixture(scope="session")
def reference_cache():
    """Target models' own greedy continuations, shared by the greedy-equality tests (test_greedy.check_prompts,
    keyed by model object, prompt and length): each is computed once per session, not once per test."""
    return {}


# The shared specs name their cache: "auto" is the dynamic one on the CPU but the static one on CUDA, and the
# chi-square cases built on these specs are labelled "dynamic" (XTOKSPEC_TEST_DEVICE=cuda runs them there).
@pytest.fixture(scope="session")
def bridged_spec(ja_target, ja_draft_bpe):
    from xtokspec import SpecConfig, XTokSpec

    return XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(cache="dynamic"))


@pytest.fixture(scope="session")
def same_spec(ja_target, ja_draft_same):
    from xtokspec import SpecConfig, XTokSpec

    return XTokSpec(ja_target, ja_draft_same, config=SpecConfig(cache="dynamic"))


@pytest.fixture(scope="session")
def tiny_target(sp_tokenizer):
    return tiny_llama(sp_tokenizer), sp_tokenizer


@pytest.fixture(scope="session")
def tiny_spec(tiny_target, bpe_tokenizer):
    from xtokspec import XTokSpec

    return XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer))
