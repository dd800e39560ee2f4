"""`xtokspec distill`'s evaluation (phase 3 of xtokspec/distill/pipeline.py): the draft before and after through xtokspec's
decoder, the teacher-forced agreement with the target's greedy text, the bootstrap interval of a paired gain, and
the report's results as lines to print."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from ..runtime.kv import input_device
from ..runtime.models import eos_ids
from ..types import SpecConfig, XTokSpecError
from .data import continue_prompts


# ---------------------------------------------------------------- phase 3: evaluation
@torch.inference_mode()
def first_difference(model, prompt_ids: list[int], reference: list[int], got: list[int]) -> dict | None:
    """Where greedy output `got` first departs from the target's own `reference` (both after `prompt_ids`):
    {"token": its index, "target": the target's id, "got": the other id, "logit": the target's logit of its own
    id, "margin": that minus the other id's, from one forward of the prompt and the common prefix}, or None where
    they agree (one a prefix of the other). A margin of a bfloat16 step or less is a floating-point near-tie; a large one is
    a bug."""
    k = next((i for i, (a, b) in enumerate(zip(reference, got, strict=False)) if a != b), None)
    if k is None:
        return None
    ids = torch.tensor([list(prompt_ids) + list(reference[:k])], device=input_device(model))
    logits = model(input_ids=ids).logits[0, -1].float()
    return {"token": k, "target": reference[k], "got": got[k], "logit": float(logits[reference[k]]),
            "margin": float(logits[reference[k]] - logits[got[k]])}


def evaluate(target, drafts: dict, prompts: Sequence[str], new_tokens: int, temperature: float = 0.7,
             seed: int = 0, progress: bool = True) -> dict:
    """Each draft (label -> (model, tokenizer)) through xtokspec drafting every cycle, against the target alone
    (target = (model, tokenizer)), interleaved prompt by prompt: greedy per-token acceptance and the greedy
    speed-up over the target alone (total time alone / total time with the draft), whether the greedy output
    equals the target's own, and tokens per target call sampling at `temperature`."""
    from tqdm.auto import tqdm

    from ..spec import XTokSpec

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


def summary_lines(report: dict) -> list[str]:
    """A report's evaluation as lines to print: the decoder's figures before -> after (the acceptance's gain with
    its interval), then the teacher-forced agreement; none without an evaluation."""
    evaluation = report.get("evaluation")
    if not evaluation:
        return []
    lines = []
    if "before" in evaluation:
        for key, label in (("token_acceptance", "greedy per-token acceptance"),
                           ("tokens_per_call_sampled", f"tokens per target call at T={evaluation['temperature']}"),
                           ("speedup", "greedy speed-up over the target alone")):
            lo, hi = evaluation["token_acceptance_gain_ci95"] if key == "token_acceptance" else (None, None)
            interval = f" (gain 95% interval {lo:+.3f} to {hi:+.3f})" if lo is not None else ""
            lines.append(f"{label} on {evaluation['prompts']} held-out prompts: "
                         f"{evaluation['before'][key]:.3f} -> {evaluation['after'][key]:.3f}{interval}")
    g = evaluation["agreement"]
    lines.append(f"teacher-forced agreement with the target's greedy text on {g['prompts']} held-out prompts: "
                 f"{g['before']:.3f} -> {g['after']:.3f} (gain {g['gain']:+.3f}, 95% interval "
                 f"{g['gain_ci95'][0]:+.3f} to {g['gain_ci95'][1]:+.3f})")
    return lines
