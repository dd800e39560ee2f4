"""A draft's output head trimmed to the ids a domain uses (`trimmed_draft`, `choose_draft_vocab`): a cheaper draft
step where the head dominates, lossless for speculative decoding (XTokSpec.trim_draft_vocab, the vLLM proposer's
`xtokspec_draft_vocab_text`)."""

from __future__ import annotations

import collections
import copy
import itertools
from dataclasses import dataclass

import torch

from ..types import XTokSpecError, is_int


class TrimmedHead(torch.nn.Module):
    """Replaces a draft's output head: logits for the `keep` ids only (one matmul over those rows), scattered into
    the full vocabulary with -inf elsewhere, so every later step (softmax, warpers, sampling, argmax, the bridge's
    tables) sees a full-size row whose excluded ids have probability 0."""

    def __init__(self, head: torch.nn.Module, keep: torch.Tensor):
        super().__init__()
        weight = head.weight.detach()
        self.vocab_size = weight.shape[0]
        # NOTE: buffers, not parameters: the kept rows are a copy, and the model's own head is untouched
        self.register_buffer("keep", keep.to(weight.device), persistent=False)
        self.register_buffer("weight", weight.index_select(0, self.keep).clone(), persistent=False)
        bias = getattr(head, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach().index_select(0, self.keep).clone(),
                             persistent=False)
        self.int8 = None  # the kept rows' matmul in int8, once quantized (`int8_linears`)

    def quantize(self, qconfig) -> None:
        """The kept rows' matmul in int8 with torch's dynamic `qconfig` (`int8_linears` passes the draft's linears'
        own): a dynamically quantized linear replaces the float rows (once: quantized again, it keeps its int8
        rows)."""
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        if self.int8 is not None:
            return

        float_linear = torch.nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():
            float_linear.weight.copy_(self.weight)
            if self.bias is not None:
                float_linear.bias.copy_(self.bias)
        float_linear.qconfig = qconfig
        self.int8 = DynamicLinear.from_float(float_linear)
        self.weight = self.weight.new_empty((self.weight.shape[0], 0))  # the float rows' memory goes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # NOTE: 2-D first. HF models pass the head a slice of the last k < T positions of (1, T, H) after a
        # multi-token feed, and torch 2.13's CPU bf16 linear with such an input and a weight that does not require
        # grad (this buffer) runs many times slower (BENCHMARKS.md, "A torch 2.13 CPU slowdown").
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.weight.device)  # (N, H)
        if self.int8 is not None:
            kept = self.int8(flat.contiguous())
        else:
            kept = torch.nn.functional.linear(flat, self.weight, self.bias)  # (N, n)
        full = kept.new_full((kept.shape[0], self.vocab_size), float("-inf")).index_copy_(1, self.keep, kept)
        return full.view(*hidden.shape[:-1], self.vocab_size)  # (..., V)

    def extra_repr(self) -> str:
        return f"kept {self.keep.numel()} of {self.vocab_size} ids"


def trimmed_draft(model, keep: torch.Tensor):
    """A view of `model` whose output head computes only the `keep` ids (1-D, long), the others -inf.

    The view shares every module, parameter and hook with `model` (only the kept head rows are copied), and
    `model` itself is left as it was. Lossless for speculative decoding with any `keep`: the draft only proposes,
    and every distribution the verifier is given is the view's own (intersection sampling draws from it and uses
    it as q). Fails with a clear error for a model whose output head is not a plain child module, or whose
    forward post-processes the logits (soft-capping, scaling), where -inf would not stay -inf.
    """
    head = model.get_output_embeddings()
    name = next((n for n, m in model._modules.items() if m is head), None)
    if head is None or name is None or getattr(getattr(head, "weight", None), "dim", lambda: 0)() != 2:
        raise XTokSpecError(
            f"draft_vocab: {type(model).__name__} has no plain output head (a Linear child of the model): "
            "its vocabulary cannot be trimmed"
        )
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(text_config, attr, None)
        if value not in (None, 1, 1.0):
            raise XTokSpecError(
                f"draft_vocab: {type(model).__name__} post-processes its logits ({attr}={value}), so the trimmed "
                "head's excluded ids would get finite logits: its vocabulary cannot be trimmed"
            )
    view = copy.copy(model)
    view.__dict__["_modules"] = dict(model._modules)  # NOTE: a new dict, so the new head does not reach `model`
    view.__dict__["_modules"][name] = TrimmedHead(head, keep)
    return view


@dataclass(frozen=True)
class DraftVocab:
    """The draft ids a trimmed output head keeps, and how they were chosen (`choose_draft_vocab`)."""

    keep: torch.Tensor  # (n,) long, ascending
    vocab_size: int  # the draft's full vocabulary
    calibration_tokens: int  # draft tokens in the calibration text
    calibration_distinct: int  # distinct ids among them
    calibration_covered: float  # share of the calibration text's tokens that are kept

    def describe(self) -> str:
        return (f"draft head trimmed to {self.keep.numel()} of {self.vocab_size} ids (covering "
                f"{self.calibration_covered:.1%} of {self.calibration_tokens} calibration tokens, "
                f"{self.calibration_distinct} distinct)")


def choose_draft_vocab(codec, texts, size: int, always=()) -> DraftVocab:
    """The `size` draft ids a trimmed head keeps: `always` (the EOS ids), every single-byte token (so the draft
    can still spell any text), then the ids most frequent in `texts` encoded by the draft's tokenizer (FR-Spec,
    Zhao et al. 2025), special tokens that occur in the text included, then the lowest remaining ids (BPE
    vocabularies list earlier merges first). Other special ids are not kept: Gemma-3 has 6,242 `<unused…>` ids.
    `codec` is the draft's TokenCodec (xtokspec.codec)."""
    if isinstance(texts, str):
        texts = [texts]
    texts = [t for t in (texts or []) if t]
    if not texts:
        raise XTokSpecError("draft_vocab: give calibration text (a list of strings in the domain you will generate)")
    vocab = codec.vocab_size
    if not is_int(size) or size < 1:
        raise XTokSpecError(f"draft_vocab: size must be a positive integer, got {size!r}")
    base = dict.fromkeys([*sorted(always), *(i for i, b in enumerate(codec.token_bytes) if len(b) == 1)])
    if size < len(base):
        raise XTokSpecError(
            f"draft_vocab: size {size} is below the {len(base)} ids always kept (EOS and single-byte "
            "tokens): give a larger size"
        )
    counts = collections.Counter()
    # NOTE: verbose=False: a long calibration passage is not a sequence for the model (no length warning)
    for ids in codec.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        counts.update(ids)
    ranked = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if i < vocab]
    chosen = dict(base)
    for i in itertools.chain(ranked, range(vocab)):  # the calibration's ids by frequency, then the lowest ids
        if len(chosen) >= size:
            break
        chosen.setdefault(i)
    keep = torch.tensor(sorted(chosen), dtype=torch.long)
    total = sum(counts.values())
    covered = sum(c for i, c in counts.items() if i in chosen) / total if total else 0.0
    return DraftVocab(keep, vocab, total, len(counts), covered)
