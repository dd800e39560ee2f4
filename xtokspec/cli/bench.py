"""`xtokspec bench`: bridged vs same-tokenizer speculative decoding against the target alone and transformers.

Systems run interleaved in one process, prompt by prompt, after a warm-up, so that machine noise hits all
of them alike. Target and draft calls are counted with forward hooks, so transformers' own assisted generation
gets the same counters as xtokspec. The figures and plots derived from the runs are `report`'s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from ..options import compile_choice
from ..runtime.kv import input_device
from ..runtime.models import CPU_LINEARS, eos_ids, fixtures_dir
from ..types import SpecConfig, XTokSpecError
from .common import write_manifest
from .presets import (
    Counter,
    Models,
    calibration_texts,
    load_preset,
)
from .report import Run, write_report

REAL_PROMPTS = ["The main advantages of Python are", "自然言語処理とは何か", "東京の観光名所を紹介します。", "Pythonでファイルを読み込むには、",
                "日本の四季について説明すると、", "機械学習のモデルを評価する方法は"]


def sampling_kwargs(mode: str) -> dict:
    if mode == "greedy":
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(mode.removeprefix("T="))}


def build_systems(models: Models, mode: str, spec_same, spec_cross, spec_cross_fixed, spec_extra=None,
                  spec_static=None, tree_widths=(), spec_tree_all=None, spec_trim=None, spec_tree_top=None,
                  spec_always=None, spec_unhealed=None, static_target_len: int = 0) -> dict:
    """name -> callable(prompt, max_new_tokens, seed) -> (new ids, xtokspec stats or None). `spec_tree_all`
    (SpecConfig(prune_tree=False)) adds a `-tree{m}-all` system beside each tree: every drafted node verified.
    `spec_tree_top` (SpecConfig(tree_root="top")) adds a `-tree{m}-top` system beside each sampled tree: the
    draft's likeliest root candidates, one-hot, instead of candidates drawn from it.
    `spec_trim` (the bridged draft with a trimmed output head, XTokSpec.trim_draft_vocab) adds a `-trim` twin of
    the bridged greedy chain, the auto sampler and each tree.
    `spec_always` ({"same": ..., "cross": ...}, SpecConfig(fallback=False)) adds an `-always` twin of each
    xtokspec chain and tree that never runs the target alone: the drafting systems as they were before the
    fallback, paired against the default.
    `spec_unhealed` (SpecConfig(draft_healing=False)) adds an `-unhealed` twin of the bridged greedy chain, the
    one-hot sampler and the auto one, the kinds that heal (with `spec_always`, its `-always` twin too:
    spec_always["unhealed"]).
    `static_target_len` > 0 adds `target-static`: the target alone through transformers' `generate` on a static
    cache of that many positions (the same for every prompt), which transformers compiles on a GPU (torch.compile,
    CUDA graphs): the target alone as fast as transformers runs it, beside xtokspec's captured steps."""
    t_model, t_tok = models.target
    kw = sampling_kwargs(mode)

    def hf(assistant=None, universal=False, static=False):
        def run(prompt, n, seed):
            torch.manual_seed(seed)
            inputs = t_tok(prompt, return_tensors="pt").to(t_model.device)
            extra = {"cache_implementation": "static", "max_cache_len": static_target_len} if static else {}
            if assistant is not None:
                extra["assistant_model"] = assistant[0]
                if universal:
                    extra.update(tokenizer=t_tok, assistant_tokenizer=assistant[1])
            with torch.inference_mode():
                out = t_model.generate(**inputs, max_new_tokens=n, **kw, **extra)
            return out[0, inputs["input_ids"].shape[1]:].tolist(), None
        return run

    def ours(spec, **extra):
        def run(prompt, n, seed):
            result = spec.generate(prompt, max_new_tokens=n, seed=seed, **kw, **extra)
            return result.token_ids, result.stats
        run.spec, run.tree_width, run.extra = spec, extra.get("tree_width", 1), extra  # what --compile warms up
        return run

    systems = {"target": hf()}
    if static_target_len:
        systems["target-static"] = hf(static=True)

    def add_trees():  # NOTE: called where the chains of each mode are, which keeps the systems' order
        for width in tree_widths:
            name = f"xtokspec-{models.cross_label}-tree{width}"
            systems[name] = ours(spec_cross, tree_width=width)
            if spec_tree_all:
                systems[name + "-all"] = ours(spec_tree_all, tree_width=width)
            if spec_tree_top and kw["do_sample"]:  # NOTE: greedy trees always take the top candidates
                systems[name + "-top"] = ours(spec_tree_top, tree_width=width)
            if spec_trim:
                systems[name + "-trim"] = ours(spec_trim, tree_width=width)

    static = spec_static or {}
    if models.draft_same:
        systems["hf-assisted"] = hf(models.draft_same)
        systems["xtokspec-same"] = ours(spec_same)
        if not kw["do_sample"] and "same" in static:  # the static KV cache backend vs the dynamic one
            systems["xtokspec-same-static"] = ours(static["same"])
    if models.draft_cross:
        # NOTE: transformers' universal sampler replaces the assistant's embedding module in place, so it
        # gets its own copy of the draft (same weights) and cannot break the draft the others use.
        hf_copy = models.draft_cross_hf_sampled if kw["do_sample"] else models.draft_cross_hf
        systems["hf-universal"] = hf(hf_copy or models.draft_cross, universal=True)
        if kw["do_sample"]:
            systems[f"xtokspec-{models.cross_label}-onehot"] = ours(spec_cross, proposal="onehot")
            if spec_unhealed:
                systems[f"xtokspec-{models.cross_label}-onehot-unhealed"] = ours(spec_unhealed, proposal="onehot")
            systems[f"xtokspec-{models.cross_label}-intersection"] = ours(spec_cross, proposal="intersection")
            systems[f"xtokspec-{models.cross_label}-auto"] = ours(spec_cross, proposal="auto")
            if spec_unhealed:
                systems[f"xtokspec-{models.cross_label}-auto-unhealed"] = ours(spec_unhealed, proposal="auto")
            if spec_trim:
                systems[f"xtokspec-{models.cross_label}-auto-trim"] = ours(spec_trim, proposal="auto")
            add_trees()  # token trees
        else:
            systems[f"xtokspec-{models.cross_label}"] = ours(spec_cross)
            if spec_unhealed:
                systems[f"xtokspec-{models.cross_label}-unhealed"] = ours(spec_unhealed)
            systems[f"xtokspec-{models.cross_label}-fixed-k"] = ours(spec_cross_fixed)
            if spec_trim:
                systems[f"xtokspec-{models.cross_label}-trim"] = ours(spec_trim)
            add_trees()
            if "cross" in static:
                systems[f"xtokspec-{models.cross_label}-static"] = ours(static["cross"])
            for label, (pair, spec) in (spec_extra or {}).items():
                systems[f"hf-universal-{label}"] = hf(pair, universal=True)
                systems[f"xtokspec-bridged-{label}"] = ours(spec)
    if spec_always:  # the twins of the chains and trees above (not of -fixed-k, -static, -all, -top, -trim)
        for name, fn in list(systems.items()):
            role = "same" if name.startswith("xtokspec-same") else "unhealed" if name.endswith("-unhealed") else "cross"
            if (hasattr(fn, "spec") and fn.spec in (spec_same, spec_cross, spec_unhealed)
                    and not name.endswith(("-fixed-k", "-static")) and spec_always.get(role)):
                systems[name + "-always"] = ours(spec_always[role], **fn.extra)
    return systems


def run_benchmark(models: Models, modes: list[str], prompts: list[str], max_new_tokens: int,
                  progress: bool = True, tree_widths: tuple[int, ...] = (), only: tuple[str, ...] = (),
                  tree_unpruned: bool = False, draft_vocab: int = 0, calibration: list[str] | None = None,
                  compile: bool | str = "auto", tree_top: bool = False, always_draft: bool = False,
                  unhealed: bool = False) -> list[Run]:
    """Every system on every prompt and mode (only the systems named in `only`, when given; the target alone,
    "target" and where it runs "target-static", always).
    `draft_vocab` > 0 adds the `-trim` systems: the bridged draft's head trimmed to that many ids, chosen from
    `calibration` (default: `calibration_texts()`). `compile`: every xtokspec system's SpecConfig.compile (the
    default, "auto": CUDA graphs on a GPU, eager on a CPU); where that captures steps (static caches, so no separate
    `-static` systems), each system records or compiles its shapes for the longest prompt before any is timed
    (`XTokSpec.warmup`). `always_draft`: the `-always` twins; `unhealed`: the `-unhealed` ones (build_systems)."""
    from tqdm.auto import tqdm

    from ..spec import XTokSpec

    t_model = models.target[0]
    target_eos = eos_ids(*models.target)
    captured = compile is True or compile in ("graphs", "inductor") or (
        compile == "auto" and input_device(t_model).type == "cuda")

    def config(**options) -> SpecConfig:
        return SpecConfig(compile=compile, **options)

    spec_same = XTokSpec(models.target, models.draft_same, config=config()) if models.draft_same else None
    spec_cross = XTokSpec(models.target, models.draft_cross, config=config()) if models.draft_cross else None
    spec_fixed = (XTokSpec(models.target, models.draft_cross, config=config(adaptive=False))
                  if models.draft_cross else None)
    spec_extra = {label: (pair, XTokSpec(models.target, pair, config=config()))
                  for label, pair in models.extra_cross.items()}
    spec_tree_all = (XTokSpec(models.target, models.draft_cross, config=config(prune_tree=False))
                     if tree_unpruned and models.draft_cross else None)
    spec_tree_top = (XTokSpec(models.target, models.draft_cross, config=config(tree_root="top"))
                     if tree_top and models.draft_cross else None)
    spec_unhealed = (XTokSpec(models.target, models.draft_cross, config=config(draft_healing=False))
                     if unhealed and models.draft_cross else None)
    spec_always = {} if not always_draft else {
        role: XTokSpec(models.target, pair, config=config(fallback=False, draft_healing=role != "unhealed"))
        for role, pair in (("same", models.draft_same), ("cross", models.draft_cross),
                           ("unhealed", models.draft_cross if spec_unhealed else None)) if pair}
    spec_trim = None
    if draft_vocab and models.draft_cross:
        spec_trim = XTokSpec(models.target, models.draft_cross, config=config())
        print(spec_trim.trim_draft_vocab(calibration or calibration_texts(), draft_vocab).describe(), flush=True)
    spec_static = {} if captured else {  # captured systems are on the static cache already
        key: XTokSpec(models.target, pair, config=SpecConfig(cache="static", compile=compile))  # eager, as the others
        for key, pair in (("same", models.draft_same), ("cross", models.draft_cross)) if pair}
    counters = {"target": Counter(), "draft": Counter()}
    handles = [t_model.register_forward_hook(counters["target"].hook, with_kwargs=True)]
    for pair in (models.draft_same, models.draft_cross, models.draft_cross_hf, models.draft_cross_hf_sampled,
                 *models.extra_cross.values()):
        if pair:
            handles.append(pair[0].register_forward_hook(counters["draft"].hook, with_kwargs=True))
    runs: list[Run] = []
    # where xtokspec captures its steps, transformers' own compiled target alone runs beside them (target-static),
    # on one cache size for every prompt, so that it compiles once
    static_len = max(len(models.target[1](p)["input_ids"]) for p in prompts) + max_new_tokens + 8 if captured else 0
    every = {m: build_systems(models, m, spec_same, spec_cross, spec_fixed, spec_extra, spec_static, tree_widths,
                              spec_tree_all, spec_trim, spec_tree_top, spec_always, spec_unhealed, static_len)
             for m in modes}
    known = set().union(*every.values())
    if set(only) - known:
        raise XTokSpecError(f"--systems: no system named {sorted(set(only) - known)}; this preset has {sorted(known)}")
    baselines = {"target", "target-static"}  # the target alone: always run
    chosen = {m: {name: fn for name, fn in systems.items() if not only or name in only or name in baselines}
              for m, systems in every.items()}
    for m, systems in chosen.items():  # e.g. greedy's "xtokspec-bridged" asked for at T=0.7, where it has a proposal
        if only and set(systems) <= baselines:
            raise XTokSpecError(f"--systems: none of {sorted(only)} runs in mode {m}, so it would time the target "
                                f"alone; that mode has {sorted(set(every[m]) - baselines)}")
    if captured:  # every shape of every chosen xtokspec system now, so that no timed run stops to capture
        longest = max(prompts, key=len)
        shapes = {(id(fn.spec), fn.tree_width): fn for systems in chosen.values() for fn in systems.values()
                  if hasattr(fn, "spec")}
        for fn in shapes.values():
            fn.spec.warmup(longest, max_new_tokens, tree_width=fn.tree_width, progress=progress)
    total = sum(map(len, chosen.values())) * len(prompts)
    bar = tqdm(total=total, desc="bench", disable=not progress)
    try:
        for mode in modes:
            systems = chosen[mode]
            for fn in systems.values():  # warm-up: first calls pay for allocation and lazy init
                fn(prompts[0], 8, 0)
            for p_index, prompt in enumerate(prompts):
                order = list(systems.items())
                random.Random(p_index).shuffle(order)  # interleaved, in a different order per prompt
                for name, fn in order:
                    for c in counters.values():
                        c.calls = 0
                    start = time.perf_counter()
                    ids, stats = fn(prompt, max_new_tokens, 1000 + p_index)
                    seconds = time.perf_counter() - start
                    # NOTE: xtokspec's own count of target calls: hooks do not see a captured step's replays
                    target_calls = stats.target_forwards if stats else counters["target"].calls
                    runs.append(Run(name, mode, p_index, seconds, len(ids), target_calls,
                                    counters["draft"].calls, stats.as_dict() if stats else {},
                                    bool(ids) and ids[-1] in target_eos))
                    bar.set_postfix_str(f"{mode} {name}")
                    bar.update()
    finally:
        bar.close()
        for h in handles:
            h.remove()
    return runs


def read_text(path: str, option: str) -> str:
    """The UTF-8 file a command-line option names (`xtokspec generate` and `bench`), or an error naming both."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise XTokSpecError(f"cannot read {option} {path!r}: {err}") from None


def calibration_lines(path: str) -> list[str]:
    """--calibration's non-empty lines: the text --draft-vocab chooses ids from."""
    lines = [line for line in read_text(path, "--calibration").splitlines() if line.strip()]
    if not lines:
        raise XTokSpecError(f"--calibration {path!r} has no text")
    return lines


def read_calibration(path: str | None, draft_vocab: int) -> list[str] | None:
    """bench's --calibration lines, or None (the built-in calibration_texts())."""
    if path is None:
        return None
    if not draft_vocab:
        raise XTokSpecError("--calibration is the text --draft-vocab N chooses ids from: give --draft-vocab too")
    return calibration_lines(path)


def main_bench(args: argparse.Namespace) -> int:
    out = Path(args.out) / args.preset
    if args.report_only:  # re-derive every figure and plot from the runs of an earlier results.json
        path = out / "results.json"
        if not path.is_file():
            raise XTokSpecError(f"--report-only needs an earlier run's {path}; run the benchmark first")
        saved = json.loads(path.read_text())
        print(write_report(out, saved["meta"], [Run(**r) for r in saved["runs"]]))
        return 0
    calibration = read_calibration(args.calibration, args.draft_vocab)  # NOTE: before loading any model
    torch.set_num_threads(args.threads) if args.threads else None
    dtype = getattr(torch, args.dtype)
    models = load_preset(args.preset, dtype, args.device, cpu_linears=args.cpu_linears)
    if args.preset == "fixtures":
        lines = (fixtures_dir() / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
        prompts = [p for p in lines if p][: args.prompts]
    else:
        prompts = REAL_PROMPTS[: args.prompts]
    runs = run_benchmark(models, args.modes, prompts, args.max_new_tokens, progress=not args.no_progress,
                         tree_widths=tuple(args.tree_widths), only=tuple(args.systems),
                         tree_unpruned=args.tree_unpruned, draft_vocab=args.draft_vocab, calibration=calibration,
                         compile=args.compile, tree_top=args.tree_top, always_draft=args.always_draft,
                         unhealed=args.unhealed)
    meta = {"preset": args.preset, "modes": args.modes, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "compile": args.compile, "cpu_linears": args.cpu_linears,
            "dtype": args.dtype, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": str(models.target[0].device), "command": "xtokspec " + " ".join(args.argv)}
    print(write_report(out, meta, runs))
    write_manifest(out, meta["command"], meta["device"], threads=meta["threads"])
    print(f"\nwritten: {out}/results.json, table.md, speedup*.png, manifest.json")
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark xtokspec against the target alone and transformers")
    bench.add_argument("--preset", choices=("fixtures", "real"), default="fixtures")
    bench.add_argument("--modes", nargs="+", default=["greedy", "T=0.3", "T=0.7", "T=1.0"])
    bench.add_argument("--prompts", type=int, default=12)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    bench.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    bench.add_argument("--device", default="cpu", help="where both models run, e.g. cuda (the GPU benchmark)")
    bench.add_argument("--cpu-linears", choices=CPU_LINEARS, default="torch",
                       help="onednn: every model's linears packed for oneDNN (float32 CPU only; faster short "
                            "forwards on CPUs without bfloat16 units; BENCHMARKS.md, 'Where verification cannot pay')")
    bench.add_argument("--compile", nargs="?", type=compile_choice, const=True, default=SpecConfig.compile,
                       metavar="{auto,graphs,inductor,off}",
                       help="the xtokspec systems' SpecConfig.compile, as generate's --compile: auto (the default) "
                            "records CUDA graphs on a GPU and runs eagerly on a CPU; a bare --compile is inductor "
                            "(minutes per system for a large model); captured systems record every shape first")
    bench.add_argument("--tree-widths", type=int, nargs="*", default=[4], metavar="W",
                       help="token-tree systems to add for the bridged draft, one per width (none: chains only)")
    bench.add_argument("--tree-unpruned", action="store_true",
                       help="beside each tree system, the same tree with every drafted node verified (-tree{W}-all)")
    bench.add_argument("--tree-top", action="store_true",
                       help="beside each tree system, in sampled modes, the same tree with the draft's likeliest root "
                            "candidates tested one-hot instead of candidates drawn from it (-tree{W}-top)")
    bench.add_argument("--always-draft", action="store_true",
                       help="beside each xtokspec chain and tree, the same system with SpecConfig(fallback=False): it "
                            "drafts every cycle even where the target alone is measured faster (-always)")
    bench.add_argument("--unhealed", action="store_true",
                       help="beside the bridged greedy chain, one-hot and auto samplers, the same system with "
                            "SpecConfig(draft_healing=False): the draft's context ends where the target's last token "
                            "does, even inside one of its own tokens (-unhealed)")
    bench.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                       help="add -trim systems: the bridged draft's output head trimmed to the N ids most frequent in "
                            "calibration text (--calibration, or by default the fixtures' held-out Japanese and "
                            "Python stdlib source; 0: none)")
    bench.add_argument("--calibration", default=None, metavar="FILE",
                       help="the text --draft-vocab chooses ids from, one passage per line (e.g. the target's own "
                            "outputs on prompts like yours)")
    bench.add_argument("--systems", nargs="*", default=[], metavar="NAME",
                       help="run only these systems (and the target alone); default: all")
    bench.add_argument("--out", default="benchmarks/results/local")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--report-only", action="store_true",
                       help="rebuild the tables and plots from OUT/PRESET/results.json without running anything")
    bench.set_defaults(func=main_bench)
