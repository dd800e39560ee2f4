"""`xtokspec distill`'s training (phase 2 of xtokspec/distill/pipeline.py): the draft's own tokenization of prompt +
continuation with the prompt out of the loss, the optional token-level loss through the intersection map, and
transformers' Trainer."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

import torch

from ..runtime.kv import input_device
from ..runtime.models import cpu_has_bf16_matmul
from ..text.codec import is_char_boundary
from ..types import XTokSpecError
from .data import DistillSettings


# ---------------------------------------------------------------- phase 2: training
def training_examples(tokenizer, records: Sequence[dict], max_length: int, codec=None,
                      target_to_draft: dict[int, int] | None = None, target_codec=None, cut_share: float = 0.0,
                      seed: int = 0) -> list[dict]:
    """Each record's prompt + continuation in the draft's tokenization (its BOS where it adds one; its EOS where
    the target ended), with the labels of every token that covers prompt characters set to -100 (out of the loss).
    Records with nothing left to learn are dropped.

    With the draft's `codec` and `target_to_draft` (target id -> the draft id of the same bytes: the intersection
    of the vocabularies) and records that have "target_top": "soft" targets for the token-level loss, at each
    continuation position where both tokenizations start a token at the same byte: the target's top ids there
    that the draft has, as draft ids, with their probabilities renormalised over those ids.

    With `target_codec` and `cut_share` > 0: that share of the records (seeded) is tokenized as the text bridge
    shows text to the draft at a cycle start, cut at one of the target's token boundaries inside the continuation
    that falls inside one of the draft's own tokens (`_cut_ids`); the draft then learns to go on from a piece its
    own tokenizer would not have ended on. The token-level loss's targets are not given to cut records."""
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    examples = []
    for r in records:
        text = r["prompt"] + r["continuation"]
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        start = len(r["prompt"])
        labels = [i if a >= start and b > a else -100 for i, (a, b) in zip(ids, offsets, strict=True)]
        cut = None
        if cut_share > 0 and codec is not None and target_codec is not None and rng.random() < cut_share:
            cut = _cut_ids(codec, target_codec, r, ids, rng)
            if cut is not None:
                ids, labels = cut
        if r["eos"] and eos is not None:
            ids.append(eos)
            labels.append(eos)
        ids, labels = ids[:max_length], labels[:max_length]
        if any(label != -100 for label in labels[1:]):  # the first position is never predicted
            example = {"input_ids": ids, "labels": labels}
            if codec is not None and target_to_draft is not None and "target_top" in r and cut is None:
                example.update(_soft_targets(codec, target_to_draft, r, ids, labels))
            examples.append(example)
    return examples


def _cut_ids(codec, target_codec, record: dict, ids: list[int], rng: random.Random):
    """The draft's ids of prompt + continuation (`ids`, its own tokenization, BOS first where it has one) as the
    text bridge leaves them at a cycle start whose committed text ends at a target token boundary inside one of
    those ids: the ids before that one, then the cut text's own encoding, then the rest of the text's encoding
    (`codec.encode_stream`, the bridge's) -> (ids, labels: the ids that start in the continuation), or None where
    no target boundary of the continuation falls inside a draft id, or the ids do not spell the text byte for
    byte (a normalizer, a dummy prefix)."""
    prompt = record["prompt"].encode("utf-8")
    text = prompt + record["continuation"].encode("utf-8")
    pieces = [codec.token_bytes[i] for i in ids]
    if b"".join(pieces) != text:
        return None
    ends = list(accumulate(len(piece) for piece in pieces))
    inside = {}  # byte position strictly inside an id -> that id's index
    for j, (piece, end) in enumerate(zip(pieces, ends, strict=True)):
        for pos in range(end - len(piece) + 1, end):
            inside[pos] = j
    _, target_ends = target_codec.encode_stream(record["continuation"])
    cuts = [len(prompt) + e for e in target_ends[:-1] if len(prompt) + e in inside]
    cuts = [c for c in cuts if is_char_boundary(text, c)]
    if not cuts:
        return None
    c = rng.choice(cuts)
    j = inside[c]
    start = ends[j] - len(pieces[j])
    while not is_char_boundary(text, start):  # a byte-level id that starts inside a character: from the one before
        j -= 1
        start = ends[j] - len(pieces[j])
    head, _ = codec.encode_stream(text[start:c].decode("utf-8"))
    tail, _ = codec.encode_stream(text[c:].decode("utf-8"))
    new = ids[:j] + head + tail
    if b"".join(codec.token_bytes[i] for i in new) != text:
        return None
    labels, pos = [], 0
    for i in new:
        piece = codec.token_bytes[i]
        labels.append(i if pos >= len(prompt) and piece else -100)
        pos += len(piece)
    return new, labels


def target_to_draft_ids(token_map) -> dict[int, int]:
    """Target id -> the draft id of the same bytes, from a `bridge.TokenMap`: the intersection of the vocabularies
    that training_examples maps the target's top ids through."""
    return {t: d for d, t in enumerate(token_map.draft_to_target) if t >= 0}


def _soft_targets(codec, target_to_draft: dict[int, int], record: dict, ids: list[int], labels: list[int]) -> dict:
    """{"soft_pos": logit positions, "soft_ids": draft ids at each, "soft_p": their target probabilities} for one
    example (see training_examples); none where the draft's tokens do not spell the text byte for byte."""
    soft = {"soft_pos": [], "soft_ids": [], "soft_p": []}
    text = (record["prompt"] + record["continuation"]).encode("utf-8")
    pieces = [codec.token_bytes[i] for i in ids]  # special tokens (BOS, EOS) stand for no bytes
    if not text.startswith(b"".join(pieces)):
        return soft  # a normalizer, a dummy prefix or an <unk>: no byte-exact boundaries
    starts, offset = [], -len(record["prompt"].encode("utf-8"))  # offsets in the continuation's bytes
    for piece in pieces:
        starts.append(offset)
        offset += len(piece)
    by_offset = {entry[0]: entry for entry in record["target_top"]}
    for i in range(1, len(ids)):
        entry = by_offset.get(starts[i]) if labels[i] != -100 and pieces[i] else None
        if entry is None:
            continue
        pairs = [(target_to_draft[t], lp) for t, lp in zip(entry[1], entry[2], strict=True) if t in target_to_draft]
        if not pairs:
            continue
        total = sum(math.exp(lp) for _, lp in pairs)
        soft["soft_pos"].append(i - 1)
        soft["soft_ids"].append([d for d, _ in pairs])
        soft["soft_p"].append([math.exp(lp) / total for _, lp in pairs])
    return soft


class _Collate:
    """Right-padded batches: pad id in input_ids, -100 in labels, 0 in the attention mask."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        width = max(len(b["input_ids"]) for b in batch)
        pad = [width - len(b["input_ids"]) for b in batch]
        out = {
            "input_ids": torch.tensor([b["input_ids"] + [self.pad_id] * n for b, n in zip(batch, pad, strict=True)]),
            "labels": torch.tensor([b["labels"] + [-100] * n for b, n in zip(batch, pad, strict=True)]),
            "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * n for b, n in zip(batch, pad, strict=True)]),
        }
        if any(b.get("soft_pos") for b in batch):  # the token-level loss's targets, padded: (B, M) and (B, M, K)
            m = max(len(b.get("soft_pos", ())) for b in batch)
            k = max((len(ids) for b in batch for ids in b.get("soft_ids", ())), default=1)
            out["soft_pos"] = torch.full((len(batch), m), -1)
            out["soft_ids"] = torch.full((len(batch), m, k), -1)
            out["soft_p"] = torch.zeros(len(batch), m, k)
            for row, b in enumerate(batch):
                for col, (pos, ids, p) in enumerate(zip(b.get("soft_pos", ()), b.get("soft_ids", ()),
                                                        b.get("soft_p", ()), strict=True)):
                    out["soft_pos"][row, col] = pos
                    out["soft_ids"][row, col, : len(ids)] = torch.tensor(ids)
                    out["soft_p"][row, col, : len(p)] = torch.tensor(p)
        return out


def soft_loss(logits: torch.Tensor, soft_pos: torch.Tensor, soft_ids: torch.Tensor, soft_p: torch.Tensor) -> torch.Tensor:
    """The token-level loss: cross-entropy of the draft's next-token distributions (logits (B, T, V)) against the
    target's mapped ones (soft_ids, soft_p: (B, M, K); soft_pos (B, M), -1 for none), averaged over positions;
    KL(p || q) up to the target's entropy, which does not depend on the draft."""
    rows, cols = (soft_pos >= 0).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return logits.sum() * 0.0
    log_q = torch.log_softmax(logits[rows, soft_pos[rows, cols]].float(), dim=-1)  # (N, V)
    ids = soft_ids[rows, cols]  # (N, K)
    picked = log_q.gather(-1, ids.clamp(min=0)) * (ids >= 0)
    return -(soft_p[rows, cols] * picked).sum(-1).mean()


def bf16_available(device: torch.device) -> bool:
    """Whether bfloat16 autocast pays where the draft trains: a GPU with bfloat16, or a CPU with AVX512-BF16 / AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16_matmul()


def _require_trainer():
    try:
        import accelerate  # noqa: F401  (transformers' Trainer needs it)
        from transformers import Trainer, TrainerCallback, TrainingArguments
    except ImportError as err:
        raise XTokSpecError(f"distillation trains with transformers' Trainer, which needs accelerate ({err}): "
                            "pip install 'xtokspec[distill]'") from None
    return Trainer, TrainerCallback, TrainingArguments


def _require_peft():
    try:
        import peft
    except ImportError:
        raise XTokSpecError("lora=True (--lora) needs peft, which is not installed: pip install 'xtokspec[distill]' "
                            "(or pip install peft), or train every weight without --lora") from None
    return peft


def train_draft(model, tokenizer, examples: list[dict], settings: DistillSettings, work: Path, *,
                deadline: float | None = None, progress: bool = True, resume: bool = False,
                extra_examples: Sequence[dict] = (), scheduler: str = "cosine", scheduler_kwargs: dict | None = None,
                warmup_share: float = 0.05):
    """Fine-tune `model` (float32 weights) on `examples` (+ `extra_examples`, e.g. plain corpus rows) with
    transformers' Trainer: AdamW (betas 0.9 / 0.95, weight decay 0.01), warmup then `scheduler` decay (a Trainer
    lr_scheduler_type, with `scheduler_kwargs`), gradient
    clipping at 1.0, bfloat16 autocast where the hardware has it; checkpoints in `work/checkpoints` (resumed from
    with `resume`). Stops at settings.max_steps or at `deadline` (time.monotonic()). Returns (the trained model,
    with LoRA adapters merged; a summary dict)."""
    Trainer, TrainerCallback, TrainingArguments = _require_trainer()
    from torch.utils.data import Dataset

    if settings.freeze_embeddings and not settings.lora:  # NOTE: LoRA freezes them anyway
        model.get_input_embeddings().weight.requires_grad_(False)
    if settings.lora:
        peft = _require_peft()
        config = peft.LoraConfig(r=settings.lora_rank, lora_alpha=2 * settings.lora_rank, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
    rows = list(examples) + list(extra_examples)
    if not rows:
        raise XTokSpecError("no training data: the target's continuations left nothing to learn (all empty)")

    class Rows(Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class Budget(TrainerCallback):
        stopped_early = False

        def on_step_end(self, args, state, control, **kwargs):
            if deadline is not None and time.monotonic() >= deadline and state.global_step < state.max_steps:
                Budget.stopped_early = True
                control.should_training_stop = True
                control.should_save = True
            return control

    token_losses: list[float] = []

    class TokenLossTrainer(Trainer):
        """Trainer whose loss adds settings.token_loss x the token-level loss (soft_loss) where a batch has targets."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            soft = {key: inputs.pop(key) for key in ("soft_pos", "soft_ids", "soft_p") if key in inputs}
            outputs = model(**inputs)
            loss = outputs.loss
            if soft:
                extra = soft_loss(outputs.logits, **soft)
                token_losses.append(extra.item())
                loss = loss + settings.token_loss * extra
            return (loss, outputs) if return_outputs else loss

    device = input_device(model)
    bf16 = bf16_available(device)
    checkpoints = work / "checkpoints"
    args = TrainingArguments(
        output_dir=str(checkpoints), max_steps=settings.max_steps, per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate, lr_scheduler_type=scheduler, lr_scheduler_kwargs=scheduler_kwargs or {},
        warmup_steps=max(1, int(warmup_share * settings.max_steps)), weight_decay=0.01, adam_beta1=0.9,
        adam_beta2=0.95, max_grad_norm=1.0, bf16=bf16, logging_steps=max(1, settings.max_steps // 20),
        save_strategy="steps", save_steps=max(10, settings.max_steps // 5), save_total_limit=1,
        report_to="none", seed=settings.seed, data_seed=settings.seed, disable_tqdm=not progress,
        use_cpu=device.type == "cpu", dataloader_num_workers=0, remove_unused_columns=False,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    kind = TokenLossTrainer if settings.token_loss > 0 else Trainer
    trainer = kind(model=model, args=args, train_dataset=Rows(), data_collator=_Collate(pad), callbacks=[Budget()])
    last = None
    if resume and checkpoints.is_dir():
        found = sorted(checkpoints.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        last = str(found[-1]) if found else None
    start = time.perf_counter()
    # also when called under no_grad or inference mode: Trainer does not switch gradients on
    with torch.inference_mode(False), torch.enable_grad():
        result = trainer.train(resume_from_checkpoint=last)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    summary = {"steps": trainer.state.global_step, "max_steps": settings.max_steps, "seconds": time.perf_counter() - start,
               "stopped_by_time": Budget.stopped_early, "resumed_from": last, "bf16": bf16, "lora": settings.lora,
               "freeze_embeddings": settings.freeze_embeddings,
               "trained_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
               "rows": len(rows), "distilled_rows": len(examples), "extra_rows": len(extra_examples),
               "first_logged_loss": losses[0] if losses else None, "last_logged_loss": losses[-1] if losses else None,
               "train_loss": result.training_loss, "token_loss_weight": settings.token_loss,
               "token_loss_first": token_losses[0] if token_losses else None,
               "token_loss_last": token_losses[-1] if token_losses else None,
               "soft_positions": sum(len(r.get("soft_pos", ())) for r in rows)}
    if settings.lora:
        model = model.merge_and_unload()
    model.eval()
    return model, summary
