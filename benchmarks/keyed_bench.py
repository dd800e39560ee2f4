"""The keyed sampler against today's sampled paths, paired per prompt: tokens per target call and speed.

    python benchmarks/keyed_bench.py [--preset fixtures|real] [--temperature 0.7] [--prompts 16] [--first 0]
                                     [--new-tokens 64] [--rounds 2] [--fixed-k K] [--systems onehot,keyed]
                                     [--device cpu|cuda] [--noise-only]
                                     [--out benchmarks/results/MACHINE/STUDY/results.json]
    python benchmarks/keyed_bench.py --pool A/results.json B/results.json --out POOLED/results.json

Systems, each `XTokSpec.generate(prompt, do_sample=True, temperature=T, seed=n)` on one XTokSpec with the
library's defaults (adaptive K, the fallback, healing): `onehot` (proposal="onehot", the residual rule), `auto`
(proposal="auto", the default for sampled chains across tokenizers), `keyed` (keyed=True with the default
proposal="auto": proposals accepted iff they equal the target's keyed sample, intersection draws coupled to its
noise), `keyed_onehot` (keyed=True, proposal="onehot"), `tree4` (tree_width=4: a sampled root, one-hot nodes below)
and `keyed_tree4` (the same keyed: the root's candidates race on the target's keyed noise). Every prompt runs every system in each round, in an order
that alternates by prompt and round (ABC, CBA, ...), after one warm-up generation per system; a system's time for
a prompt is its median over rounds. Ratios are paired per prompt (keyed / onehot, keyed / auto, keyed_onehot /
onehot, keyed_tree4 / tree4, keyed_tree4 / keyed), the median and a one-sided 95% bootstrap lower bound (scipy,
percentile, fixed rng); beside the speed, the same pairs of target calls per second (speed over tokens per call:
what a rule costs per cycle, apart from what it happened to accept). Also the keyed noise's own cost per cycle:
`keyed.noise` for K + 1 rows of the target's vocabulary, timed alone. One torch thread.

Prompt n is sampled with seed n, counted in the whole prompt list, so `--first` runs a later slice of prompts in
another process (one per core, each one thread) and `--pool` lays such runs side by side as one set of prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SYSTEMS = {"onehot": dict(proposal="onehot"), "auto": dict(proposal="auto"), "keyed": dict(keyed=True),
           "keyed_onehot": dict(keyed=True, proposal="onehot"), "tree4": dict(tree_width=4),
           "keyed_tree4": dict(keyed=True, tree_width=4)}
PAIRS = [("keyed", "onehot"), ("keyed", "auto"), ("keyed_onehot", "onehot"), ("keyed_tree4", "tree4"),
         ("keyed_tree4", "keyed")]  # (numerator, denominator)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=("fixtures", "real"), default="fixtures")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--first", type=int, default=0, help="skip this many prompts (another process's slice)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fixed-k", type=int, metavar="K", help="every system drafts K every cycle (adaptive=False: "
                        "no fallback), so the rules alone differ; default: the library's adaptive defaults")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all); pairs of them are reported")
    parser.add_argument("--device", default="cpu", help="where the fixture pair runs (cuda: the GPU figures)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the real pair's weights (float32 on a CPU without bfloat16 units)")
    parser.add_argument("--noise-only", action="store_true", help="only the keyed noise's cost on --device")
    parser.add_argument("--pool", type=Path, nargs="+", metavar="RESULTS",
                        help="only pool these runs of other prompts (the same settings) into --out")
    parser.add_argument("--out", type=Path, help="write results.json (and results.md beside it) here")
    return parser


def load(preset: str, device: str, dtype: str = "bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xtokspec import XTokSpec

    if preset == "fixtures":
        models = ROOT / "fixtures" / "models"
        pair = [(AutoModelForCausalLM.from_pretrained(models / name, dtype=torch.float32).eval().to(device),
                 AutoTokenizer.from_pretrained(models / name)) for name in ("ja-target", "ja-draft-bpe")]
        spec = XTokSpec(*pair)
        lines = (ROOT / "fixtures" / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
        return spec, [line for line in lines if line]
    from real_models import real_model_dir

    if device != "cpu":
        raise SystemExit("--preset real runs on the CPU here (the real weights do not travel to a GPU machine)")
    spec = XTokSpec(str(real_model_dir("qwen2.5-coder-1.5b")), str(real_model_dir("gemma-3-270m")),
                    large_kwargs={"dtype": getattr(torch, dtype)}, small_kwargs={"dtype": getattr(torch, dtype)})
    lines = (ROOT / "fixtures" / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()
    return spec, [line for line in lines if 40 <= len(line) <= 120]


def noise_cost(vocab: int, device: str = "cpu", rows: int = 5, repeats: int = 20) -> float:
    """Seconds of keyed.noise over `rows` positions of `vocab` ids on `device` (the median of `repeats`, after one
    call that builds the vocabulary's token keys)."""
    import torch

    from xtokspec.decode import keyed

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    keyed.noise(0, range(rows), vocab, device=device)
    times = []
    for n in range(repeats):
        sync()
        t0 = time.perf_counter()
        keyed.noise(n, range(rows), vocab, device=device)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def summarise(runs: dict[str, list[list[dict]]], fixed_k: bool = False) -> tuple[dict, dict]:
    """Per system, the median over prompts of tokens/s (a prompt's median over rounds) and the mean tokens per
    call; per pair of systems, the paired ratios' median and 95% lower bound, of speed and of calls per second;
    at a fixed K, keyed one-hot over one-hot's speed with acceptance as a control variate (`controlled`)."""
    from common import lower_bound

    summary = {}
    for name, per_prompt in runs.items():
        per = [{"tokens_per_s": statistics.median(x["tokens"] / x["seconds"] for x in rounds),
                "tokens_per_call": sum(x["tokens"] for x in rounds) / sum(x["calls"] for x in rounds),
                "calls_per_s": statistics.median(x["calls"] / x["seconds"] for x in rounds)} for rounds in per_prompt]
        summary[name] = {"tokens_per_s": statistics.median(p["tokens_per_s"] for p in per),
                         "tokens_per_call": statistics.mean(p["tokens_per_call"] for p in per), "per_prompt": per}
    pairs, ratios = {}, {}
    for name, other in [pair for pair in PAIRS if set(pair) <= set(runs)]:
        for measure, label in (("tokens_per_s", ""), ("calls_per_s", " per call")):
            these = ratios[name, other, measure] = [
                k[measure] / o[measure]
                for k, o in zip(summary[name]["per_prompt"], summary[other]["per_prompt"], strict=True)]
            pairs[f"{name}/{other}{label}"] = {"median": statistics.median(these), "lower95": lower_bound(these),
                                               "prompts": len(these)}
    if fixed_k and ("keyed_onehot", "onehot", "tokens_per_s") in ratios:
        speed = ratios["keyed_onehot", "onehot", "tokens_per_s"]
        estimate, lower = controlled(speed, ratios["keyed_onehot", "onehot", "calls_per_s"])
        pairs["keyed_onehot/onehot, acceptance controlled"] = {"mean": estimate, "lower95": lower,
                                                               "prompts": len(speed)}
    return summary, pairs


def controlled(speed: list[float], per_call: list[float], seed: int = 0) -> tuple[float, float]:
    """Paired per-prompt ratios of speed and of target calls per second (keyed one-hot over one-hot, the draft's
    greedy ids at a fixed K) -> the expected speed ratio, estimated with the ratio of tokens per target call as a
    control variate, and its one-sided 95% bootstrap lower bound (percentile, fixed rng).

    Speed is tokens per call times calls per second, so log(speed ratio) = X + log(per-call ratio) with X the log
    of the tokens-per-call ratio. Under the two rules a generation's target calls are a function of its text, and
    both texts follow the target's law (reference/keyed.py, item 7): the two counts are independent draws of one
    law, and X has mean zero. The estimate is exp(mean(log speed) - beta mean(X)), beta fitted by least squares
    (the textbook control variate): it keeps the expected speed ratio and drops the variance that the two texts'
    own luck adds to each prompt. Elsewhere (adaptive lengths, random drafts, other rules) X's mean is not known
    to be zero, and this estimate does not apply."""
    import numpy as np
    from scipy import stats

    def estimate(log_speed, x):
        beta = np.cov(x, log_speed)[0, 1] / np.var(x, ddof=1) if np.var(x) > 0 else 0.0
        return float(np.exp(np.mean(log_speed) - beta * np.mean(x)))

    log_speed = np.log(np.asarray(speed, dtype=float))
    x = log_speed - np.log(np.asarray(per_call, dtype=float))
    result = stats.bootstrap((log_speed, x), estimate, paired=True, vectorized=False, confidence_level=0.95,
                             alternative="greater", method="percentile", n_resamples=9999,
                             rng=np.random.default_rng(seed))
    return estimate(log_speed, x), float(result.confidence_interval.low)


def report(header: str, summary: dict, pairs: dict, costs: dict | None) -> list[str]:
    lines = [header, "", "| system | tokens/s (median over prompts) | tokens per target call |", "|---|---|---|"]
    lines += [f"| {name} | {summary[name]['tokens_per_s']:.2f} | {summary[name]['tokens_per_call']:.2f} |"
              for name in summary]
    lines += ["", "| paired per prompt | median | 95% lower |", "|---|---|---|"]
    lines += [f"| {k} | {v.get('median', v.get('mean')):.3f} | {v['lower95']:.3f} |" for k, v in pairs.items()]
    if costs:
        lines += ["", f"keyed noise for 5 positions: {costs['noise_s_5_rows'] * 1e3:.2f} ms over {costs['vocab']} ids, "
                  f"{costs['noise_s_5_rows_151936'] * 1e3:.2f} ms over 151,936 (Qwen's vocabulary)"]
    return lines


def write(out: Path, lines: list[str], data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1), encoding="utf-8")
    out.with_name("results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def pool(paths: list[Path], out: Path) -> None:
    """Runs over separate slices of prompts (`--first`) as one results.json: their prompts side by side."""
    loaded = [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    settings = [data["header"].split(", ") for data in loaded]
    for path, data, these in zip(paths, loaded, settings, strict=True):
        # the header names machine, pair, T, prompts x tokens, rounds and K: all but the prompt count must agree
        if [x for x in these if "prompts x" not in x] != [x for x in settings[0] if "prompts x" not in x]:
            raise SystemExit(f"--pool: {path} ran other settings than {paths[0]}:\n{data['header']}\n"
                             f"{loaded[0]['header']}")
        if sorted(data["runs"]) != sorted(loaded[0]["runs"]):
            raise SystemExit(f"--pool: {path} ran {sorted(data['runs'])}, {paths[0]} {sorted(loaded[0]['runs'])}")
    runs = {name: [rounds for data in loaded for rounds in data["runs"][name]] for name in loaded[0]["runs"]}
    summary, pairs = summarise(runs, fixed_k="every cycle" in loaded[0]["header"])
    count = len(next(iter(runs.values())))
    header = ", ".join(f"{count} prompts x {x.split(' prompts x ')[1].split(' (from')[0]}" if "prompts x" in x else x
                       for x in settings[0]) + f"; {len(paths)} runs pooled"
    lines = report(header, summary, pairs, None)
    print("\n".join(lines))
    write(out, lines, {"header": header, "pooled": [str(path) for path in paths],
                       "commands": [data["command"] for data in loaded], "summary": summary, "pairs": pairs,
                       "runs": runs})


def main() -> None:
    args = build_parser().parse_args()
    if args.pool:
        if not args.out:
            raise SystemExit("--pool writes the pooled results.json to --out")
        return pool(args.pool, args.out)
    fixed = {} if args.fixed_k is None else {"num_draft_tokens": args.fixed_k, "adaptive": False}
    names = [name for name in args.systems.split(",") if name]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose among {list(SYSTEMS)}")
    import torch
    from common import cpu_name, write_manifest

    torch.set_num_threads(1)
    if args.out:
        write_manifest(args.out.parent, args.device, threads=1)
    if args.noise_only:
        costs = {"device": args.device, **{f"noise_s_5_rows_{v}": noise_cost(v, args.device) for v in (96000, 151936)}}
        print(json.dumps(costs))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(costs, indent=1) + "\n", encoding="utf-8")
        return
    spec, prompts = load(args.preset, args.device, args.dtype)
    prompts = prompts[args.first: args.first + args.prompts]
    if not prompts:
        raise SystemExit(f"--first {args.first}: the preset has fewer prompts than that")
    for name in names:  # warm-up
        spec.generate(prompts[0], max_new_tokens=8, do_sample=True, temperature=args.temperature, seed=0,
                      **SYSTEMS[name], **fixed)
    runs = {name: [[] for _ in prompts] for name in names}
    progress = tqdm(total=args.rounds * len(prompts) * len(names), unit="generation", desc="keyed_bench")
    for r in range(args.rounds):
        for n, prompt in enumerate(prompts):
            order = names if (n + r) % 2 == 0 else names[::-1]
            for name in order:
                result = spec.generate(prompt, max_new_tokens=args.new_tokens, do_sample=True,
                                       temperature=args.temperature, seed=args.first + n, **SYSTEMS[name], **fixed)
                s = result.stats
                runs[name][n].append({"seconds": s.wall_seconds, "tokens": s.new_tokens, "calls": s.target_forwards,
                                      "drafted": s.drafted, "accepted": s.accepted, "ids": result.token_ids})
                progress.update()
    progress.close()
    summary, pairs = summarise(runs, fixed_k=args.fixed_k is not None)
    vocab = spec.target_model.config.vocab_size
    costs = {"vocab": vocab, "noise_s_5_rows": noise_cost(vocab, args.device),
             "noise_s_5_rows_151936": noise_cost(151936, args.device)}
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    header = (f"keyed sampler ({machine}, 1 torch thread), {args.preset} pair"
              + (f" ({args.dtype})" if args.preset == "real" else "") + f", T={args.temperature}, "
              f"{len(prompts)} prompts x {args.new_tokens} tokens"
              + (f" (from prompt {args.first})" if args.first else "") + f", {args.rounds} rounds, "
              + ("adaptive defaults" if args.fixed_k is None else f"K={args.fixed_k} every cycle"))
    lines = report(header, summary, pairs, costs)
    print("\n".join(lines))
    if args.out:
        write(args.out, lines, {"header": header, "command": "python benchmarks/keyed_bench.py "
                                + " ".join(sys.argv[1:]), "summary": summary, "pairs": pairs, "costs": costs,
                                "runs": runs})


if __name__ == "__main__":
    main()
