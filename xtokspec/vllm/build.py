"""What a proposer is built from, once, in its constructor: the draft and the pair xtokspec bridges
(`load_pair`), the draft's head trimmed to a calibration text's ids (`trim`), and how its requests will draft
(`choose_ways`). The per-step work is the proposer's (proposer.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..decode import assemble
from ..runtime.kv import position_bytes, sliding_layers
from ..runtime.models import eos_ids, int8_linears, load
from ..runtime.vocab import choose_draft_vocab, trimmed_draft
from ..text.codec import TokenCodec
from ..types import XTokSpecError, is_int
from .settings import CACHE_KEY, GRAPHS_KEY, LINEARS_KEY, TRIM_SIZE_KEY, TRIM_TEXT_KEY, ProposerSettings

log = logging.getLogger("xtokspec")


@dataclass
class Loaded:
    """The draft on vLLM's device, the target's tokenizer and vocabulary size, and the pair built from them."""

    draft_model: torch.nn.Module
    draft_tokenizer: object
    target_tokenizer: object
    target_vocab: int
    pair: assemble.Pair
    device: torch.device


def load_pair(model_config, settings: ProposerSettings, device: str) -> Loaded:
    """The draft (on vLLM's device), the target's tokenizer and EOS ids, and the pair xtokspec bridges."""
    from transformers import AutoTokenizer

    try:
        draft_model, draft_tokenizer = load(settings.draft, f"draft {settings.draft!r}", dtype=settings.dtype)
    except XTokSpecError:
        raise
    except Exception as err:  # NOTE: any failure of loading names the draft (vLLM wraps it in its own error)
        raise XTokSpecError(
            f"draft {settings.draft!r}: could not load it ({err.__class__.__name__}: {err})") from err
    draft_model.to(device)
    target_tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer, revision=getattr(model_config, "tokenizer_revision", None),
        trust_remote_code=model_config.trust_remote_code)
    target_vocab = model_config.get_vocab_size()
    eos = model_config.try_get_generation_config().get("eos_token_id")
    eos = eos if eos is not None else target_tokenizer.eos_token_id
    target_eos = set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    pair = assemble.Pair.of(
        TokenCodec(target_tokenizer, target_vocab, "target tokenizer"),
        TokenCodec(draft_tokenizer, draft_model.config.vocab_size, f"draft {settings.draft!r} tokenizer"),
        target_eos, eos_ids(draft_model, draft_tokenizer))
    return Loaded(draft_model, draft_tokenizer, target_tokenizer, target_vocab, pair, torch.device(device))


def trim(pair: assemble.Pair, draft_model, path, size) -> tuple[torch.nn.Module, object]:
    """The draft's output head trimmed to the `size` ids most frequent in the calibration file's lines -> (the
    trimmed draft, the ids kept)."""
    try:
        with open(path, encoding="utf-8") as f:
            texts = [line for line in f.read().splitlines() if line.strip()]
    except OSError as err:
        raise XTokSpecError(f"{TRIM_TEXT_KEY}: cannot read the calibration text {path!r} ({err})") from err
    if not is_int(size) or size < 1:
        raise XTokSpecError(f"{TRIM_SIZE_KEY}: a positive number of ids, got {size!r}")
    vocab = choose_draft_vocab(pair.draft, texts, size, pair.draft_eos)
    log.info("xtokspec proposer: %s", vocab.describe())
    return trimmed_draft(draft_model, vocab.keep), vocab


def int8(draft_model, device: torch.device) -> None:
    """The draft's linears quantized to int8 (`runtime.models.int8_linears`: CPU only), logged."""
    if device.type != "cpu":
        raise XTokSpecError(f"{LINEARS_KEY}='int8' quantizes the draft's linears for the CPU; vLLM runs it on "
                            f"{device}")
    count = int8_linears(draft_model)
    log.info("xtokspec proposer: %d of the draft's linears in int8 (%s)", count, LINEARS_KEY)


@dataclass
class Ways:
    """How the requests draft, chosen once: `ways` is ("batched",), ("alone",) or both (the cheaper of the two at
    each step, from the costs measured: decode.stepcosts.StepCosts.way)."""

    ways: tuple[str, ...]
    batched: bool  # batched forwards over the requests' caches side by side (batch.draft_together)
    window: int | None  # a sliding-window draft's window (None: full attention)
    static_len: int  # a static cache's positions
    step: object | None  # the captured draft step (each request's steps replayed as CUDA graphs), or None
    backend: str  # the draft caches' kind: "static" or "dynamic"


def choose_ways(draft_model, device: torch.device, settings: ProposerSettings, kept: assemble.Kept, max_seqs: int,
                max_model_len: int, draft_limit: int, max_states: int) -> Ways:
    """Batched forwards over the requests' caches copied side by side (static ones included, which keep their
    buffers and graphs), each its own forwards, or with captured graphs the cheaper of the two at each step; and
    their caches' kind. `max_states`: the requests whose captured graphs stay recorded."""
    # batched drafting: for full-attention drafts, and for sliding-window ones while the batch fits the window
    sliding = sliding_layers(draft_model)
    window = getattr(draft_model.config.get_text_config(decoder=True), "sliding_window", None) if sliding else None
    batched = settings.batched and (not sliding or (sliding == ["sliding_attention"] and isinstance(window, int)))
    # a static cache's positions (a draft spends up to ~2.4 ids on a target id's text, SmolLM2 on Qwen's
    # Japanese); past them the draft keeps the most recent half of its text, as at its context's end
    static_len = min(draft_limit, settings.cache_len or max(256, 2 * max_model_len))
    # Captured drafts: each request's draft steps recorded as CUDA graphs over a static cache of its own, replayed
    # at each step (xtokspec's GraphedStep, as XTokSpec's default on a GPU); a dropped request's cache goes to the
    # next new request with its graphs. Where graphs cannot be recorded (the CPU, a sliding-window draft) a warning
    # says why and the draft runs eagerly. By default on a GPU, where a static cache for every running request
    # fits the draft caches' bound (static caches hold all their positions from the start).
    graphs = settings.graphs
    if graphs is None:
        needed = max_seqs * static_len * position_bytes(draft_model)
        graphs = (device.type == "cuda" and not sliding and settings.cache != "dynamic"
                  and needed <= settings.memory_mib * 2**20)
    step = kept.step(draft_model, "graphs", "static", "draft") if graphs else None
    cache = settings.cache or ("static" if step is not None else "dynamic")
    if cache == "static" and sliding:
        raise XTokSpecError(f"{CACHE_KEY}='static': the draft has {sliding} layers, which a static cache cannot "
                            "roll back; use 'dynamic'")
    if step is not None and cache != "static":
        raise XTokSpecError(f"{GRAPHS_KEY} records the draft's steps over static caches: {CACHE_KEY}={cache!r}")
    if step is not None:
        step.KEPT_CACHES = max_states  # every live request's graphs stay recorded
    ways = ("batched", "alone") if batched and step is not None else ("batched",) if batched else ("alone",)
    return Ways(ways, batched, window, static_len, step, cache)
