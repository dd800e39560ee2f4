"""`xtokspec distill`: align a draft (any tokenizer xtokspec bridges) to its target, so that the target accepts
more of what it drafts.

Three phases, each resumable:

1. Data: the target continues the training prompts in left-padded batches, greedily and by sampling its full
   distribution (T=1, no top-k / top-p): greedy text teaches the draft the target's argmax, which greedy
   speculation pays for; samples teach its spread (maximum likelihood on samples of p minimises KL(p || q), and
   sampled speculation accepts 1 - TV(p, q)). A continuation is cut at the first byte that does not complete a
   UTF-8 character (byte-fallback tokens can stop inside one), without its EOS.
2. Training: sequence-level distillation in the draft's own tokenization (which works for any pair): the draft
   learns prompt + continuation as its tokenizer writes it, the prompt's tokens masked out of the loss, with
   transformers' `Trainer` (bfloat16 autocast where the CPU or GPU has bfloat16 units); LoRA through peft as an
   option. Optionally a token-level loss as well (`token_loss`): where both tokenizations start a token at the
   same byte, cross-entropy of the draft's next token against the target's top ids there, mapped to the draft's
   ids of the same bytes (the intersection of the vocabularies, `mapping.VocabMaps.token_map`).
3. Evaluation: on held-out prompts that training never saw, the draft before and after, through xtokspec's own
   decoder drafting every cycle: greedy per-token acceptance (`GenerationStats.token_acceptance`), tokens per
   target call at T=0.7, and the speed-up over the target alone, paired prompt by prompt in one run.

The model is written into `<out>.partial/` (with the data, the settings and Trainer's checkpoints) and renamed
to `out` at the end, so `out` never holds a half-written model; an interrupted run resumes from that folder.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .codec import utf8_valid_prefix_len
from .kv import input_device
from .models import check_source, cpu_has_bf16_matmul, eos_ids, load
from .types import SpecConfig, XTokSpecError

REPORT_FILE = "distill_report.json"
DATA_FILE = "distill_data.jsonl"
SETTINGS_FILE = "settings.json"
STATE_FILE = "state.json"
MODES = ("greedy", "sampled")


@dataclasses.dataclass
class DistillSettings:
    """What a run does; everything but the budget's seconds must match when a run resumes."""

    new_tokens: int = 64  # target tokens per continuation
    modes: tuple[str, ...] = MODES  # continuations per prompt: greedy, sampled (T=1, full distribution), or both
    max_prompts: int | None = None  # training prompts used (None: all)
    prompt_chars: tuple[int, int] | None = None  # cut each prompt to a seeded length in [min, max] characters
    gen_batch: int = 16  # prompts per batched target generate
    max_steps: int = 200  # optimizer steps
    batch_size: int = 16  # sequences per step
    learning_rate: float = 5e-5  # peak; pretrained drafts diverge at 5e-4 (Gemma-3-270M: loss 3.1 -> 17 in 2 steps)
    max_length: int = 256  # draft tokens per training sequence (longer ones are cut)
    lora: bool = False  # train LoRA adapters (peft) and merge them, instead of every weight
    lora_rank: int = 16
    token_loss: float = 0.0  # weight of the token-level cross-tokenizer loss (0: sequence-level alone)
    token_top_k: int = 16  # target probabilities kept per position for it
    eval_count: int = 16  # held-out prompts split off the prompt source when no eval_prompts are given
    eval_new_tokens: int = 64
    eval_temperature: float = 0.7
    seed: int = 0
    dtype: str = "auto"  # both models' dtype for generation and evaluation ("auto": the checkpoint's own)

    def check(self) -> None:
        if not self.modes or set(self.modes) - set(MODES):
            raise XTokSpecError(f"modes must be one or both of {MODES}, got {self.modes!r}")
        for name in ("new_tokens", "gen_batch", "max_steps", "batch_size", "max_length", "lora_rank",
                     "eval_new_tokens", "token_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise XTokSpecError(f"{name} must be a positive integer, got {value!r}")
        if self.max_prompts is not None and self.max_prompts <= 0:
            raise XTokSpecError(f"max_prompts must be a positive integer, got {self.max_prompts!r}")
        if self.eval_count < 0:
            raise XTokSpecError(f"eval_count must be 0 or more, got {self.eval_count!r}")
        if self.prompt_chars is not None and not 0 < self.prompt_chars[0] <= self.prompt_chars[1]:
            raise XTokSpecError(f"prompt_chars must be (min, max) with 0 < min <= max, got {self.prompt_chars!r}")
        if not self.token_loss >= 0:
            raise XTokSpecError(f"token_loss must be 0 or more, got {self.token_loss!r}")
        if not self.learning_rate > 0:
            raise XTokSpecError(f"learning_rate must be positive, got {self.learning_rate!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise XTokSpecError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


# ---------------------------------------------------------------- prompts
def read_prompts(source, what: str = "prompts") -> list[str]:
    """Prompts from a list of strings, or from a file: a text file (one prompt per line) or JSON lines (.jsonl,
    each an object with a "prompt" or "text" field). Empty lines are skipped; none left is an error."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise XTokSpecError(f"cannot read the {what} file {str(path)!r}: {err}") from None
        if path.suffix == ".jsonl":
            prompts = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise XTokSpecError(f"{path}:{n}: not JSON ({err})") from None
                value = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
                if not isinstance(value, str):
                    raise XTokSpecError(f'{path}:{n}: a JSON line needs a "prompt" or "text" string field')
                prompts.append(value)
        else:
            prompts = text.splitlines()
        where = f"the {what} file {str(path)!r}"
    else:
        prompts = list(source)
        if not all(isinstance(p, str) for p in prompts):
            raise XTokSpecError(f"{what}: expected strings or a file path")
        where = f"the {what} given"
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise XTokSpecError(f"{where} has no prompts (no non-empty line)")
    return prompts


def split_prompts(prompts: list[str], eval_prompts: list[str] | None, settings: DistillSettings
                  ) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): the held-out ones are `eval_prompts` when given, else
    `settings.eval_count` prompts drawn (seeded) from the source; a training prompt never equals a held-out one."""
    rng = random.Random(settings.seed)
    order = list(dict.fromkeys(prompts))  # de-duplicated, first occurrence kept
    rng.shuffle(order)
    if eval_prompts is None:
        if settings.eval_count and len(order) <= settings.eval_count:
            raise XTokSpecError(f"{len(order)} distinct prompts cannot keep {settings.eval_count} held out and "
                                "train on the rest: give more prompts, eval_prompts (--eval-prompts FILE), or a "
                                "smaller eval_count (--eval-count)")
        held, train = order[: settings.eval_count], order[settings.eval_count :]
    else:
        held = list(dict.fromkeys(eval_prompts))[: settings.eval_count or None] if settings.eval_count else []
        train = [p for p in order if p not in set(eval_prompts)]
        if not train:
            raise XTokSpecError("every training prompt is also a held-out prompt: nothing is left to train on")
    if settings.prompt_chars is not None:
        lo, hi = settings.prompt_chars
        train = [p[: rng.randint(lo, hi)] for p in train]
        train = [p for p in dict.fromkeys(train) if p.strip() and p not in set(held)]
    if settings.max_prompts is not None:
        train = train[: settings.max_prompts]
    return train, held


# ---------------------------------------------------------------- phase 1: the target's continuations
@torch.no_grad()
def continue_prompts(model, tokenizer, prompts: Sequence[str], mode: str, new_tokens: int, seed: int,
                     codec=None, top_k: int = 0) -> list[dict]:
    """The target's continuations of one batch of prompts (left-padded, one `generate` call): greedy, or sampled
    from its full distribution (T=1). -> records {"prompt", "continuation", "eos", "mode", "cut"}; "cut": the
    continuation ended inside a UTF-8 character (or hit invalid UTF-8) and was cut there, without its EOS.
    `top_k` > 0 adds "target_top": for each continuation token that starts inside the kept text, [its byte offset
    in the continuation, the target's `top_k` likeliest next ids there, their log-probabilities] (one more forward
    over the batch), for the token-level loss."""
    from .codec import TokenCodec

    codec = codec or TokenCodec(tokenizer, model.config.vocab_size, "target tokenizer")
    eos = eos_ids(model, tokenizer)
    ids = [codec.encode_prompt(p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos) if eos else 0
    width = max(map(len, ids))
    device = input_device(model)
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids], device=device)  # (B, T)
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids], device=device)
    how = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if mode == "sampled" else dict(do_sample=False)
    torch.manual_seed(seed)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                         min_new_tokens=0, pad_token_id=pad, eos_token_id=sorted(eos) or None, **how)  # (B, T + n)
    top = None
    if top_k:
        mask = torch.cat([attention_mask, torch.ones_like(out[:, width:])], dim=1)  # (B, T + n)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row
        logits = model(input_ids=out, attention_mask=mask, position_ids=positions).logits[:, width - 1 : -1]
        top = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)  # values, indices: (B, n, top_k)
    records = []
    for row, (prompt, new) in enumerate(zip(prompts, out[:, width:].tolist(), strict=True)):
        ended = next((n for n, i in enumerate(new) if i in eos), None)
        new = new if ended is None else new[:ended]
        data = codec.bytes_of(new)
        valid = utf8_valid_prefix_len(data)
        cut = valid < len(data)
        record = {"prompt": prompt, "continuation": data[:valid].decode("utf-8"),
                  "eos": ended is not None and not cut, "mode": mode, "cut": cut}
        if top is not None:
            record["target_top"], offset = [], 0
            for j, token in enumerate(new):
                if offset >= valid:
                    break
                record["target_top"].append([offset, top.indices[row, j].tolist(),
                                             [round(v, 4) for v in top.values[row, j].tolist()]])
                offset += len(codec.token_bytes[token])
        records.append(record)
    return records


# ---------------------------------------------------------------- phase 2: training
def training_examples(tokenizer, records: Sequence[dict], max_length: int, codec=None,
                      target_to_draft: dict[int, int] | None = None) -> list[dict]:
    """Each record's prompt + continuation in the draft's tokenization (its BOS where it adds one; its EOS where
    the target ended), with the labels of every token that covers prompt characters set to -100 (out of the loss).
    Records with nothing left to learn are dropped.

    With the draft's `codec` and `target_to_draft` (target id -> the draft id of the same bytes: the intersection
    of the vocabularies) and records that have "target_top": "soft" targets for the token-level loss, at each
    continuation position where both tokenizations start a token at the same byte: the target's top ids there
    that the draft has, as draft ids, with their probabilities renormalised over those ids."""
    eos = tokenizer.eos_token_id
    examples = []
    for r in records:
        text = r["prompt"] + r["continuation"]
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        if r["eos"] and eos is not None:
            ids.append(eos)
            offsets.append((len(text), len(text) + 1))
        start = len(r["prompt"])
        labels = [i if a >= start and b > a else -100 for i, (a, b) in zip(ids, offsets, strict=True)]
        ids, labels = ids[:max_length], labels[:max_length]
        if any(label != -100 for label in labels[1:]):  # the first position is never predicted
            example = {"input_ids": ids, "labels": labels}
            if codec is not None and target_to_draft is not None and "target_top" in r:
                example.update(_soft_targets(codec, target_to_draft, r, ids, labels))
            examples.append(example)
    return examples


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
    result = trainer.train(resume_from_checkpoint=last)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    summary = {"steps": trainer.state.global_step, "max_steps": settings.max_steps, "seconds": time.perf_counter() - start,
               "stopped_by_time": Budget.stopped_early, "resumed_from": last, "bf16": bf16, "lora": settings.lora,
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


# ---------------------------------------------------------------- phase 3: evaluation
def evaluate(target, drafts: dict, prompts: Sequence[str], new_tokens: int, temperature: float = 0.7,
             seed: int = 0, progress: bool = True) -> dict:
    """Each draft (label -> (model, tokenizer)) through xtokspec drafting every cycle, against the target alone
    (target = (model, tokenizer)), interleaved prompt by prompt: greedy per-token acceptance and the greedy
    speed-up over the target alone (total time alone / total time with the draft), whether the greedy output
    equals the target's own, and tokens per target call sampling at `temperature`."""
    from tqdm.auto import tqdm

    from .spec import XTokSpec

    model, tokenizer = target
    eos = sorted(eos_ids(model, tokenizer)) or None
    specs = {label: XTokSpec(target, pair, config=SpecConfig(fallback=False)) for label, pair in drafts.items()}
    device = input_device(model)

    def alone(prompt: str, n: int) -> tuple[list[int], float]:
        ids = torch.tensor([next(iter(specs.values())).target.encode_prompt(prompt)], device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, eos_token_id=eos, pad_token_id=eos[0] if eos else None)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start

    totals = {label: dict(accepted=0, rejections=0, greedy_seconds=0.0, greedy_tokens=0, same_output=0,
                          sampled_tokens=0, sampled_calls=0) for label in specs}
    alone_seconds = alone_tokens = 0
    alone(prompts[0], 8)  # warm-up: first calls pay for allocation and lazy initialisation
    for spec in specs.values():
        spec.generate(prompts[0], max_new_tokens=8)
    bar = tqdm(total=len(prompts), desc="evaluating", disable=not progress)
    for n, prompt in enumerate(prompts):
        reference, seconds = alone(prompt, new_tokens)
        alone_seconds, alone_tokens = alone_seconds + seconds, alone_tokens + len(reference)
        order = list(specs.items())
        random.Random(n).shuffle(order)
        for label, spec in order:
            t = totals[label]
            start = time.perf_counter()
            greedy = spec.generate(prompt, max_new_tokens=new_tokens)
            t["greedy_seconds"] += time.perf_counter() - start
            t["greedy_tokens"] += len(greedy.token_ids)
            t["accepted"] += greedy.stats.accepted
            t["rejections"] += greedy.stats.rejections
            t["same_output"] += greedy.token_ids == reference
            sampled = spec.generate(prompt, max_new_tokens=new_tokens, do_sample=True, temperature=temperature,
                                    seed=seed + n)
            t["sampled_tokens"] += sampled.stats.new_tokens
            t["sampled_calls"] += sampled.stats.target_forwards
        bar.update()
    bar.close()
    result = {"prompts": len(prompts), "new_tokens": new_tokens, "temperature": temperature,
              "target_alone_tokens_per_second": alone_tokens / max(alone_seconds, 1e-9)}
    for label, t in totals.items():
        result[label] = {
            "token_acceptance": t["accepted"] / max(1, t["accepted"] + t["rejections"]),
            "tokens_per_call_sampled": t["sampled_tokens"] / max(1, t["sampled_calls"]),
            "greedy_tokens_per_second": t["greedy_tokens"] / max(t["greedy_seconds"], 1e-9),
            "speedup": alone_seconds / max(t["greedy_seconds"], 1e-9),
            "greedy_same_as_target": f"{t['same_output']}/{len(prompts)}",
        }
    return result


# ---------------------------------------------------------------- the whole run
def _hash(items: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(items).encode("utf-8")).hexdigest()[:16]


def _name(spec) -> str:
    if isinstance(spec, (tuple, list)):
        return str(getattr(spec[0], "name_or_path", "") or type(spec[0]).__name__)
    return str(spec)


def _load_kwargs(dtype: str, device: str | None) -> dict:
    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if device:
        kwargs["device_map"] = device
    return kwargs


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the interruption: it is generated again
            break
    return records


def _log(message: str, progress: bool) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"[xtokspec distill] {message}")


def distill(target, draft, prompts, out, *, eval_prompts=None, settings: DistillSettings | None = None,
            max_seconds: float | None = None, overwrite: bool = False, resume: bool = False,
            target_device: str | None = None, draft_device: str | None = None, progress: bool = True,
            **setting_overrides) -> dict:
    """Distil `target` into `draft` on the target's continuations of `prompts`; write the distilled draft to the
    folder `out` (weights, tokenizer, `distill_report.json`, the data as `distill_data.jsonl`). -> the report.

    `target`, `draft`: a folder, a hub id, a bundled name or a loaded (model, tokenizer) pair, as `XTokSpec`
    takes them. `prompts`: a list of strings or a file (text, one prompt per line; or .jsonl with a "prompt" or
    "text" field). `eval_prompts` (same kinds): the held-out prompts; by default `eval_count` prompts of the
    source are held out. `settings` (or its fields as keywords: new_tokens, modes, max_prompts, prompt_chars,
    max_steps, batch_size, learning_rate, lora, eval_count, eval_new_tokens, seed, dtype, ...): see
    `DistillSettings`. `max_seconds`: a wall budget for data and training (generation stops starting batches
    past half of it; training stops at it); evaluation comes on top. `overwrite`: replace an existing `out`
    (kept until the new one is complete) or discard an interrupted run's folder. `resume`: continue the
    interrupted run in `<out>.partial/` (its data and last checkpoint).
    """
    start = time.monotonic()
    settings = dataclasses.replace(settings or DistillSettings(), **setting_overrides)
    if settings.prompt_chars is not None:
        settings.prompt_chars = tuple(settings.prompt_chars)
    settings.modes = tuple(settings.modes)
    settings.check()
    if max_seconds is not None and not max_seconds > 0:
        raise XTokSpecError(f"max_seconds must be positive, got {max_seconds!r}")
    # Everything that can be checked without the models comes first (loading takes seconds to minutes).
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    if out.exists() and not overwrite:
        raise XTokSpecError(f"{str(out)!r} exists: choose another output folder, or pass overwrite=True "
                            "(--overwrite) to replace it (it is kept until the new draft is complete)")
    if partial.exists() and not resume:
        if not overwrite:
            raise XTokSpecError(f"an interrupted run left {str(partial)!r}: pass resume=True (--resume) to continue "
                                "it, or overwrite=True (--overwrite) to discard it and start over")
        shutil.rmtree(partial)
    _require_trainer()
    if settings.lora:
        _require_peft()
    source = read_prompts(prompts)
    held = read_prompts(eval_prompts, "held-out prompts") if eval_prompts is not None else None
    train_prompts, held = split_prompts(source, held, settings)
    check_source(target, "target (large)")
    check_source(draft, "draft (small)")
    identity = {"target": _name(target), "draft": _name(draft), "train_prompts": _hash(train_prompts),
                "eval_prompts": _hash(held), "settings": {k: list(v) if isinstance(v, tuple) else v
                                                          for k, v in dataclasses.asdict(settings).items()}}
    settings_path = partial / SETTINGS_FILE
    if settings_path.exists():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        if saved != identity:
            differ = sorted(k for k in identity if saved.get(k) != identity[k])
            raise XTokSpecError(f"--resume: {str(partial)!r} was started with other {', '.join(differ)}; rerun with "
                                "the same ones, or pass overwrite=True (--overwrite) without resume to start over")

    # The pair is loaded and checked as xtokspec will run it (a tokenizer it cannot bridge is refused here, before
    # anything is written).
    from .spec import XTokSpec

    _log(f"loading {identity['target']} and {identity['draft']}", progress)
    spec = XTokSpec(target, draft, large_kwargs=_load_kwargs(settings.dtype, target_device),
                    small_kwargs=_load_kwargs(settings.dtype, draft_device))
    t_model, t_tok = spec.target_model, spec.target_tokenizer
    d_model, d_tok = spec.draft_model, spec.draft_tokenizer
    partial.mkdir(parents=True, exist_ok=True)
    if not settings_path.exists():
        settings_path.write_text(json.dumps(identity, ensure_ascii=False, indent=1), encoding="utf-8")
    state_path = partial / STATE_FILE
    state = json.loads(state_path.read_text(encoding="utf-8")) if state_path.exists() else {}

    # Phase 1: data
    data_path = partial / DATA_FILE
    records = _read_records(data_path)
    with data_path.open("w", encoding="utf-8") as f:  # rewritten whole: a line cut by an interruption goes
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    gen_start = time.perf_counter()
    if not state.get("data_done"):
        from tqdm.auto import tqdm

        done = {(r["index"], r["mode"]) for r in records}
        gen_deadline = None if max_seconds is None else start + max_seconds / 2
        batches = [range(i, min(i + settings.gen_batch, len(train_prompts)))
                   for i in range(0, len(train_prompts), settings.gen_batch)]
        bar = tqdm(total=len(train_prompts) * len(settings.modes), initial=len(done), desc="target continues",
                   disable=not progress)
        stopped = False
        with data_path.open("a", encoding="utf-8") as f:
            for b, batch in enumerate(batches):
                for m, mode in enumerate(settings.modes):
                    todo = [i for i in batch if (i, mode) not in done]
                    if not todo:
                        continue
                    if gen_deadline is not None and time.monotonic() >= gen_deadline:
                        stopped = True
                        break
                    new = continue_prompts(t_model, t_tok, [train_prompts[i] for i in todo], mode, settings.new_tokens,
                                           settings.seed * 1_000_003 + b * len(MODES) + m, spec.target,
                                           settings.token_top_k if settings.token_loss > 0 else 0)
                    for i, r in zip(todo, new, strict=True):
                        r["index"] = i
                        f.write(json.dumps(r, ensure_ascii=False) + "\n")
                    f.flush()
                    records += new
                    bar.update(len(todo))
                if stopped:
                    break
        bar.close()
        state.update(data_done=True, data_stopped_by_time=stopped,
                     data_seconds=state.get("data_seconds", 0.0) + time.perf_counter() - gen_start)
        state_path.write_text(json.dumps(state), encoding="utf-8")
    if not records:
        raise XTokSpecError("the time budget ended before the target continued any prompt: give more max_seconds")

    # Phase 2: training (a float32 copy of the draft; saved in the draft's own dtype)
    torch.manual_seed(settings.seed)
    keep_dtype = d_model.dtype
    student = copy.deepcopy(d_model).to(torch.float32).train()
    target_to_draft = None
    if settings.token_loss > 0:  # the intersection of the vocabularies: ids of the same bytes in both
        target_to_draft = {t: d for d, t in enumerate(spec.vocab_maps.token_map.draft_to_target) if t >= 0}
    examples = training_examples(d_tok, records, settings.max_length, spec.draft, target_to_draft)
    deadline = None if max_seconds is None else start + max_seconds
    _log(f"training on {len(examples)} sequences ({len(records)} continuations)", progress)
    student, train_summary = train_draft(student, d_tok, examples, settings, partial, deadline=deadline,
                                         progress=progress, resume=resume)
    staged = partial / "model"
    if staged.exists():
        shutil.rmtree(staged)
    student.to(keep_dtype).save_pretrained(staged)
    d_tok.save_pretrained(staged)
    shutil.copyfile(data_path, staged / DATA_FILE)
    distill_seconds = time.monotonic() - start

    # Phase 3: evaluation on the held-out prompts, the draft as saved against the draft as it was
    evaluation = None
    if held:
        after = load(staged, "distilled draft", **_load_kwargs(settings.dtype, draft_device))
        evaluation = evaluate((t_model, t_tok), {"before": (d_model, d_tok), "after": after}, held,
                              settings.eval_new_tokens, settings.eval_temperature, settings.seed, progress)
        evaluation["gain"] = {key: evaluation["after"][key] - evaluation["before"][key]
                              for key in ("token_acceptance", "tokens_per_call_sampled", "speedup")}
    report = {
        "target": identity["target"], "draft": identity["draft"], "settings": identity["settings"],
        "max_seconds": max_seconds,
        "data": {"train_prompts": len(train_prompts), "continuations": len(records),
                 "per_mode": {m: sum(r["mode"] == m for r in records) for m in settings.modes},
                 "ended_with_eos": sum(r["eos"] for r in records), "cut_inside_utf8": sum(r["cut"] for r in records),
                 "training_sequences": len(examples), "seconds": state.get("data_seconds"),
                 "stopped_by_time": state.get("data_stopped_by_time", False)},
        "training": train_summary,
        "distill_seconds": distill_seconds,
        "eval_prompts": len(held),
        "evaluation": evaluation,
        "seconds": time.monotonic() - start,
        "device": str(input_device(t_model)),
    }
    (staged / REPORT_FILE).write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")

    # The finished folder replaces `out` by renames; an old `out` (overwrite) goes only once the new one is there.
    old = out.with_name(out.name + ".old") if out.exists() else None
    if old is not None:
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    staged.rename(out)
    if old is not None:
        shutil.rmtree(old)
    shutil.rmtree(partial)
    if evaluation:
        b, a = evaluation["before"], evaluation["after"]
        _log(f"held-out acceptance {b['token_acceptance']:.3f} -> {a['token_acceptance']:.3f}; tokens/call at "
             f"T={settings.eval_temperature} {b['tokens_per_call_sampled']:.2f} -> {a['tokens_per_call_sampled']:.2f}; "
             f"speed-up {b['speedup']:.2f}x -> {a['speedup']:.2f}x", progress)
    _log(f"wrote {out} ({report['seconds']:.0f} s)", progress)
    return report
