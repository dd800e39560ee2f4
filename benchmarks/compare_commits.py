"""Speed of one xtokspec source tree against another on the same machine: the check for a refactor that
should change no behaviour.

    python benchmarks/compare_commits.py --old /tmp/xts-old --new . --out /tmp/compare
    python benchmarks/compare_commits.py --old /tmp/xts-old --new . --fixed-k 4 --repeats 2   # exact sampled ids

Each tree runs in its own long-lived worker process (this file, started with the tree first on PYTHONPATH, so
that the tree's own `xtokspec` is imported; the worker checks and prints where it was imported from). A worker
loads the models once, warms up and then serves one generation per request. The controller sends the same
requests to both workers in turn, old and new alternately, the order flipped for every pair (ABBA), so that
drifts of the machine's speed hit both trees alike; only one worker computes at a time.

Systems: "bridged" (the draft has its own tokenizer) and "same" (the draft shares the target's), each greedy and
sampled at T=0.7 with a fixed seed per prompt, with `SpecConfig(fallback=False)` (every cycle drafts), and with a
fixed number of drafted tokens per cycle when `--fixed-k` is given.

What the table says, per system and mode:
- new/old: the median over prompts of the ratio of tokens per second (new tokens / `stats.wall_seconds`),
  new tree over old tree, each prompt's speed the median of its `--repeats`. 1.00 is "no change"; below 1 the
  new tree is slower.
- 95% lower: a one-sided 95% lower bound of that median ratio (bootstrap over prompts, percentile method, fixed
  seed). A lower bound well below 1 with a median near 1 means the run cannot rule out a slowdown of that size:
  run more prompts or repeats. With a handful of prompts the bound is coarse.
- overhead ms/cycle: the loop's own time per cycle, outside both models' forwards: (wall seconds - seconds
  inside the target's and the draft's `forward`) / target forwards, the median over prompts. This is where a
  refactor of the decoding loop shows, undiluted by the models' compute.
- mismatches: prompts whose generated ids differ between the trees. A behaviour-preserving change has none for
  greedy. Sampled runs draw from seeded generators, but with the adaptive draft length (the default) K follows
  measured timings, and a different K consumes the random stream differently: sampled ids may then differ
  between any two runs, even of one tree; with `--fixed-k` they must match.

Forward time is measured by wrapping each model's `forward` on the instance (`functools.wraps` of the bound
method); before measuring, each worker checks that generations with and without the wrapper give the same ids.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from common import cpu_name, lower_bound, write_manifest

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("bridged", "same")
MODES = ("greedy", "T=0.7")
FIXTURE_DRAFTS = {"bridged": "ja-draft-bpe", "same": "ja-draft-same"}
REAL_MODELS = {"target": "qwen2.5-coder-1.5b", "same": "qwen2.5-coder-0.5b", "bridged": "gemma-3-270m"}


# ---------------------------------------------------------------------------------------------------- worker
class ForwardTimer:
    """Accumulates the seconds spent inside the wrapped models' `forward` (synchronised on CUDA)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds = 0.0

    def wrap(self, model) -> None:
        import torch

        original = model.forward  # the bound method (or whatever the instance already carries)
        cuda = self.cuda

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - start

        model.forward = timed


def _sampling(mode: str, seed: int) -> dict:
    if mode == "greedy":
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(mode.removeprefix("T=")), "seed": seed}


def _load_models(preset: str, fixtures: Path, dtype, device: str) -> dict:
    """role ("target", "bridged", "same") -> (model, tokenizer), loaded the same way in both workers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(path)

    if preset == "fixtures":
        paths = {"target": fixtures / "models" / "ja-target",
                 **{role: fixtures / "models" / name for role, name in FIXTURE_DRAFTS.items()}}
    else:
        try:  # raises a clear XTokSpecError when a model is absent
            from xtokspec.cli.presets import real_model_dir
        except ImportError:  # NOTE: a worker on a tree from before xtokspec's packages finds it in xtokspec.bench
            from xtokspec.bench import real_model_dir

        paths = {role: real_model_dir(name) for role, name in REAL_MODELS.items()}
    models = {role: load(path) for role, path in paths.items()}
    if preset == "real":
        for role in ("target", "same"):
            models[role][0].generation_config.repetition_penalty = 1.0  # as `xtokspec bench` does
    return models


class Worker:
    def __init__(self, setup: dict, tree: Path):
        import torch

        import xtokspec
        from xtokspec import SpecConfig, XTokSpec

        self.torch = torch
        imported = Path(xtokspec.__file__).resolve()
        if not imported.is_relative_to(tree.resolve()):
            raise RuntimeError(f"xtokspec was imported from {imported}, not from the tree {tree}")
        print(f"[worker {tree}] xtokspec from {imported}", file=sys.stderr, flush=True)
        torch.set_num_threads(setup["threads"])
        torch.manual_seed(0)
        models = _load_models(setup["preset"], Path(setup["fixtures"]), getattr(torch, setup["dtype"]),
                              setup["device"])
        config = SpecConfig(**setup["config"])
        self.specs = {system: XTokSpec(models["target"], models[system], config=config) for system in SYSTEMS}
        self.timer = ForwardTimer(setup["device"].startswith("cuda"))

        # warm-up (every system and mode once, unwrapped), then the same generations wrapped: identical ids
        prompt, n, seed = setup["warmup_prompt"], setup["max_new_tokens"], 0
        reference = {(s, m): self._generate(s, m, prompt, n, seed)["token_ids"] for s in SYSTEMS for m in MODES}
        for role in ("target", *SYSTEMS):
            self.timer.wrap(models[role][0])
        wrapped = {(s, m): self._generate(s, m, prompt, n, seed) for s in SYSTEMS for m in MODES}
        self.hello = {
            "tree": str(tree), "xtokspec_file": str(imported), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "wrapper_check": {f"{s} {m}": reference[s, m] == wrapped[s, m]["token_ids"] for s, m in reference},
            "wrapper_forward_seconds": sum(r["forward_seconds"] for r in wrapped.values()),
            "describe": {s: spec.describe() if hasattr(spec, "describe") else "?" for s, spec in self.specs.items()},
        }

    def _generate(self, system: str, mode: str, prompt: str, max_new_tokens: int, seed: int) -> dict:
        spec = self.specs[system]
        self.timer.seconds = 0.0
        start = time.perf_counter()
        result = spec.generate(prompt, max_new_tokens=max_new_tokens, **_sampling(mode, seed))
        call_seconds = time.perf_counter() - start
        stats = result.stats
        forward = self.timer.seconds
        wall = stats.wall_seconds
        cycles = stats.target_forwards
        return {
            "tokens_per_s": stats.new_tokens / wall if wall > 0 else float("nan"),
            "wall_seconds": wall, "call_seconds": call_seconds, "new_tokens": stats.new_tokens,
            "cycles": cycles, "draft_forwards": stats.draft_forwards, "forward_seconds": forward,
            "outside_seconds": wall - forward,
            "overhead_per_cycle": (wall - forward) / cycles if cycles else float("nan"),
            "token_ids": list(result.token_ids),
        }

    def serve(self, request: dict) -> dict:
        return self._generate(request["system"], request["mode"], request["prompt"],
                              request["max_new_tokens"], request["seed"])


def worker_main(tree: Path, setup: dict) -> int:
    # NOTE: answers go to a private copy of stdout; anything else printing to stdout (libraries, C code) lands on
    # stderr and cannot corrupt the protocol
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    try:
        worker = Worker(setup, tree)
    except Exception as exc:  # reported to the controller, which stops
        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send(worker.hello)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            send(worker.serve(request))
        except Exception as exc:  # reported; the worker serves on
            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"})
    return 0


# ---------------------------------------------------------------------------------------------------- controller
class WorkerProcess:
    def __init__(self, label: str, tree: Path, setup: dict, threads: int):
        self.label, self.tree = label, tree
        env = dict(os.environ)
        env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--worker-setup",
                   json.dumps(setup)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        cwd=str(tree), text=True, encoding="utf-8", bufsize=1)

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise SystemExit(f"error: the {self.label} worker ({self.tree}) exited with status {code} "
                             "(its traceback is above)")
        answer = json.loads(line)
        if "error" in answer:
            raise SystemExit(f"error: the {self.label} worker ({self.tree}) failed: {answer['error']}")
        return answer

    def request(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


def git_describe(tree: Path) -> str:
    def git(*args):
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "--", "xtokspec")
    return commit + (" + uncommitted changes in xtokspec/" if dirty else "")


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def median(values):
    values = [v for v in values if v == v]  # NaN-free
    return statistics.median(values) if values else float("nan")


def load_prompts(path: Path, count: int) -> tuple[list[str], str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"error: no prompts in {path}")
    prompts = lines[:count]
    warmup = lines[count] if len(lines) > count else lines[-1]  # a prompt that is not measured, when there is one
    return prompts, warmup


def compare(workers: dict, prompts: list[str], args) -> list[dict]:
    groups = []
    pair = 0
    for system in SYSTEMS:
        for mode in args.modes:
            rows = []
            for index, prompt in enumerate(prompts):
                seed = args.seed + index
                runs = {"old": [], "new": []}
                mismatch = None
                for repeat in range(args.repeats):
                    order = ("old", "new") if pair % 2 == 0 else ("new", "old")
                    pair += 1
                    answers = {}
                    for side in order:
                        answers[side] = workers[side].request(system=system, mode=mode, prompt=prompt,
                                                              max_new_tokens=args.max_new_tokens, seed=seed)
                        runs[side].append(answers[side])
                    old_ids, new_ids = answers["old"]["token_ids"], answers["new"]["token_ids"]
                    if old_ids != new_ids and mismatch is None:
                        mismatch = {"repeat": repeat, "position": first_difference(old_ids, new_ids),
                                    "old_len": len(old_ids), "new_len": len(new_ids),
                                    "old_ids": old_ids, "new_ids": new_ids}  # for the logit margin there
                        print(f"!!!!! MISMATCH {system} {mode} prompt {index} (repeat {repeat}): token ids differ "
                              f"from position {mismatch['position']} (old {len(old_ids)} ids, new "
                              f"{len(new_ids)} ids) !!!!!", flush=True)
                row = {"prompt": index, "seed": seed, "mismatch": mismatch}
                for side in ("old", "new"):
                    row[side] = {
                        "tokens_per_s": median(r["tokens_per_s"] for r in runs[side]),
                        "overhead_ms_per_cycle": 1000 * median(r["overhead_per_cycle"] for r in runs[side]),
                        "new_tokens": runs[side][0]["new_tokens"], "cycles": runs[side][0]["cycles"],
                        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs[side]],
                    }
                row["ratio"] = row["new"]["tokens_per_s"] / row["old"]["tokens_per_s"]
                rows.append(row)
                print(f"  {system:7} {mode:6} prompt {index:2}: old {row['old']['tokens_per_s']:8.1f} tok/s "
                      f"new {row['new']['tokens_per_s']:8.1f} tok/s  new/old {row['ratio']:.3f}  overhead "
                      f"{row['old']['overhead_ms_per_cycle']:.3f} / {row['new']['overhead_ms_per_cycle']:.3f} "
                      f"ms/cycle  {'MISMATCH' if mismatch else 'ids equal'}", flush=True)
            ratios = [r["ratio"] for r in rows]
            groups.append({
                "system": system, "mode": mode, "prompts": len(rows),
                "ratio_median": median(ratios), "ratio_lower95": lower_bound(ratios),
                "old_overhead_ms": median(r["old"]["overhead_ms_per_cycle"] for r in rows),
                "new_overhead_ms": median(r["new"]["overhead_ms_per_cycle"] for r in rows),
                "old_tokens_per_s": median(r["old"]["tokens_per_s"] for r in rows),
                "new_tokens_per_s": median(r["new"]["tokens_per_s"] for r in rows),
                "mismatches": sum(r["mismatch"] is not None for r in rows),
                "rows": rows,
            })
    return groups


def table(groups: list[dict]) -> list[str]:
    lines = ["| system | mode | prompts | new/old tok/s | 95% lower | overhead ms/cycle old | new | "
             "tok/s old | new | mismatches |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in groups:
        lines.append(f"| {g['system']} | {g['mode']} | {g['prompts']} | {g['ratio_median']:.3f} | "
                     f"{g['ratio_lower95']:.3f} | {g['old_overhead_ms']:.3f} | {g['new_overhead_ms']:.3f} | "
                     f"{g['old_tokens_per_s']:.1f} | {g['new_tokens_per_s']:.1f} | {g['mismatches']} |")
    return lines


def controller_main(args) -> int:
    old, new = Path(args.old).resolve(), Path(args.new).resolve()
    for tree in (old, new):
        if not (tree / "xtokspec" / "__init__.py").is_file():
            raise SystemExit(f"error: {tree} has no xtokspec/__init__.py: not an xtokspec source tree")
    fixtures = Path(args.fixtures).resolve()
    prompts, warmup_prompt = load_prompts(Path(args.prompts_file), args.prompts)
    config = {"fallback": False}
    if args.fixed_k:
        config.update(adaptive=False, num_draft_tokens=args.fixed_k, max_draft_tokens=max(12, args.fixed_k))
    setup = {"preset": args.preset, "fixtures": str(fixtures), "dtype": args.dtype, "device": args.device,
             "threads": args.threads, "config": config, "max_new_tokens": args.max_new_tokens,
             "warmup_prompt": warmup_prompt}

    workers = {}
    try:
        # both load and warm up at once; the measurements afterwards run one worker at a time
        for label, tree in (("old", old), ("new", new)):
            workers[label] = WorkerProcess(label, tree, setup, args.threads)
        hello = {label: worker.receive() for label, worker in workers.items()}

        header = [f"cpu: {cpu_name()} ({os.cpu_count()} logical cores); device {args.device}",
                  f"torch {hello['old']['torch']}, threads {hello['old']['threads']} (old) / "
                  f"{hello['new']['threads']} (new); transformers {hello['old']['transformers']}; "
                  f"python {hello['old']['python']}",
                  f"preset {args.preset} ({args.dtype}); SpecConfig({', '.join(f'{k}={v}' for k, v in config.items())}); "
                  f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.repeats} repeat(s), ABBA order; "
                  f"modes {', '.join(args.modes)}"]
        for label, tree in (("old", old), ("new", new)):
            header.append(f"{label}: {tree} [{git_describe(tree)}] imports {hello[label]['xtokspec_file']}")
        for label in ("old", "new"):
            checks = hello[label]["wrapper_check"]
            bad = [name for name, same in checks.items() if not same]
            note = "identical ids with and without the forward wrapper" if not bad else \
                f"!!!!! ids CHANGE with the forward wrapper: {', '.join(bad)} !!!!!"
            header.append(f"{label} wrapper check: {note}")
        header.append(f"models: {hello['old']['describe']['bridged']}; same-tokenizer draft: "
                      f"{hello['old']['describe']['same'].split('; ')[-1]}")
        print("\n".join(header), flush=True)

        started = time.perf_counter()
        groups = compare(workers, prompts, args)
        elapsed = time.perf_counter() - started
    finally:
        for worker in workers.values():
            worker.close()

    lines = table(groups)
    print()
    print("\n".join(lines))
    total = sum(g["mismatches"] for g in groups)
    # greedy ids must match; sampled ids too when K is fixed (an adaptive K follows timings, see the docstring)
    must_match = sum(g["mismatches"] for g in groups if g["mode"] == "greedy" or args.fixed_k)
    if total:
        print(f"\n!!!!! {total} prompt(s) with differing token ids between old and new (see above), "
              f"{must_match} of them where ids must match !!!!!")
    if len(prompts) < 8:
        print(f"\n(with {len(prompts)} prompts the bootstrap bound can only take a few values: a rough guide)")
    print(f"\n({elapsed:.0f} s of measurement)")

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out, args.device)
        result = {"header": header, "args": vars(args), "setup": setup, "hello": hello, "groups": groups,
                  "measurement_seconds": elapsed}
        (out / "results.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        md = ["# xtokspec: new tree against old tree", "", *[f"- {line}" for line in header], "", *lines, "",
              "new/old: median over prompts of the new tree's tokens/s over the old tree's; 95% lower: one-sided "
              "bootstrap lower bound of that median; overhead: (wall - seconds inside both models' forward) per "
              "target forward, median over prompts."]
        (out / "results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
        print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 1 if must_match else 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", help="the baseline source tree (a checkout or worktree holding xtokspec/)")
    parser.add_argument("--new", help="the source tree compared against it")
    parser.add_argument("--preset", choices=("fixtures", "real"), default="fixtures",
                        help="fixtures: the bundled Japanese fixture models; real: the converted real models "
                             "under xtokspec.cli.presets.real_models_root() (as `xtokspec bench --preset real`)")
    parser.add_argument("--fixtures", default=str(ROOT / "fixtures"),
                        help="the fixtures folder both workers load the fixture models from (default: this "
                             "checkout's), so that both trees run the same weights")
    parser.add_argument("--prompts-file", default=str(ROOT / "fixtures" / "data" / "prompts.txt"),
                        help="prompts, one per non-empty line (default: the fixtures' prompts.txt)")
    parser.add_argument("--prompts", type=int, default=12, help="how many prompts: the file's first N")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=1,
                        help="generations per prompt and tree; each prompt's speed is their median")
    parser.add_argument("--fixed-k", type=int, default=0, metavar="K",
                        help="draft K tokens every cycle (SpecConfig(adaptive=False, num_draft_tokens=K)); "
                             "default 0: the adaptive draft length")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the decoding modes measured (both systems run each)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i's sampled runs use seed SEED + i")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each worker")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the models' dtype")
    parser.add_argument("--device", default="cpu", help="where the models run, e.g. cuda")
    parser.add_argument("--out", default=None, help="folder to write results.json and results.md to")
    parser.add_argument("--worker", default=None, metavar="TREE",
                        help="(internal) run as the worker for TREE, serving requests from stdin")
    parser.add_argument("--worker-setup", default=None, metavar="JSON", help="(internal) the worker's settings")
    args = parser.parse_args(argv)
    if args.worker is None:
        if not args.old or not args.new:
            parser.error("--old and --new are required")
        for name in ("prompts", "max_new_tokens", "repeats", "threads"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1")
        if args.fixed_k < 0:
            parser.error("--fixed-k must be positive (or 0 for the adaptive draft length)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(Path(args.worker), json.loads(args.worker_setup))
    return controller_main(args)


if __name__ == "__main__":
    sys.exit(main())
