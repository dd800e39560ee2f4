"""The loop's own overhead per cycle at the 13B pair's shapes on a GPU, measured inside the loop.

gpu.py measures each model call alone. This runs `XTokSpec.generate` end to end with random-weight bf16 models of
the 13B pair's shapes (llm-jp-13b: GPT-2 style, 40 layers, hidden 5120; open-calm-small: GPT-NeoX, 12 layers,
hidden 768), each with the vocabulary of a fixture tokenizer (the SentencePiece target's, and the byte-level BPE
draft's or the target's own for the same-tokenizer pair), so that the real bridge runs on real token bytes.

Every model call of the loop (`ModelState.forward`, `feed`, `forward_tree`, `grow_tree`) is bracketed by CUDA events, which
the host never waits on; after the run one synchronisation reads them. The loop's overhead is the run's wall time
minus the time between each call's two events: the bridge, sampling and acceptance, host syncs and Python.

Random weights accept next to nothing, so every cycle is a whole draft of K tokens and a verification of K+1 and
emits about one token: these are per-cycle costs, not speedups. transformers' assisted generation runs on the same
shapes (same tokenizer, K drafted every cycle), and the target's own `generate`, for the cost per cycle beside it.

    python benchmarks/gpu_loop.py --out "$OUT/loop"                  # on the GPU machine (about 2 minutes)
    python benchmarks/gpu_loop.py --compile --out "$OUT/loop-c"      # the same with CUDA graphs
    python benchmarks/gpu_loop.py --compile --tree-width 4 --out "$OUT/loop-t"  # captured width-4 trees
    python benchmarks/gpu_loop.py --tiny --device cpu --out /tmp/loop # smoke test on a CPU
Writes loop.json and loop.md to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_manifest  # noqa: E402
from gpu import build, shapes, sync  # noqa: E402

from xtokspec import SpecConfig, XTokSpec  # noqa: E402
from xtokspec.runtime.cache import ModelState  # noqa: E402

FIXTURES = ROOT / "fixtures" / "models"
PROMPTS = ["使用する C コンパイラが", "ファイルシステムをマウントするには", "表計算ドキュメントのセル範囲は、"]


class CallTimer:
    """Brackets ModelState's model calls with CUDA events (no host wait); `seconds()` syncs once and sums them."""

    METHODS = ("forward", "feed", "forward_tree", "grow_tree")

    def __init__(self, device: str, target=None):
        self.cuda = device.startswith("cuda")
        self.target = target  # the target model: its calls are "target ...", every other model's "draft ..."
        self.events: list[tuple] = []
        self.host: dict[str, float] = {}  # on a CPU the calls are synchronous: wall time is the call time
        self.originals = {name: getattr(ModelState, name) for name in self.METHODS}

    def __enter__(self):
        for name, original in self.originals.items():
            def timed(state, *args, _original=original, _name=name, **kwargs):
                if not self.cuda:
                    start = time.perf_counter()
                    out = _original(state, *args, **kwargs)
                    key = f"{self.role(state)} {_name}"
                    self.host[key] = self.host.get(key, 0.0) + time.perf_counter() - start
                    return out
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                out = _original(state, *args, **kwargs)
                end.record()
                self.events.append((f"{self.role(state)} {_name}", begin, end))
                return out
            setattr(ModelState, name, timed)
        return self

    def role(self, state) -> str:
        return "target" if state.model is self.target else "draft"

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(ModelState, name, original)

    def seconds(self) -> dict[str, float]:
        """Seconds in model calls per "role method" (e.g. "target forward_tree", "draft grow_tree")."""
        if not self.cuda:
            return dict(self.host)
        torch.cuda.synchronize()
        out: dict[str, float] = {}
        for key, begin, end in self.events:
            out[key] = out.get(key, 0.0) + begin.elapsed_time(end) / 1e3
        return out


def tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURES / name)


def with_vocab(config, size: int):
    config = config.__class__.from_dict(config.to_dict())
    config.vocab_size = size
    return config


def no_eos(model, tok) -> None:
    """Random weights pick EOS now and then; the cost per cycle needs full-length runs, so EOS is moved to an id
    whose output row is zeroed (logit 0 ties nothing in practice among thousands of random logits)."""
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[tok.eos_token_id] = head.min()  # far below every other row's typical logit


def run_xtokspec(spec: XTokSpec, tokens: int, device: str) -> dict:
    # compile=True: every shape now, so that no timed prompt meets a new one (a first compile at the 13B shapes
    # stalls a generation for tens of seconds)
    start = time.perf_counter()
    shapes = spec.warmup(max(PROMPTS, key=len), max_new_tokens=tokens, progress=False)
    warmup_s = time.perf_counter() - start
    spec.generate(PROMPTS[0], max_new_tokens=tokens)  # warm-up (allocates)
    rows = []
    for prompt in PROMPTS:
        with CallTimer(device, spec.target_model) as timer:
            sync(device)
            start = time.perf_counter()
            result = spec.generate(prompt, max_new_tokens=tokens)
            sync(device)
            wall = time.perf_counter() - start
            calls = timer.seconds()
        model = sum(calls.values())
        cycles = result.stats.target_forwards
        rows.append({"prompt": prompt, "tokens": len(result.token_ids), "cycles": cycles,
                     "draft_forwards": result.stats.draft_forwards, "nodes": result.stats.drafted / cycles,
                     "healed": result.stats.healed_cycles,
                     "wall_s": wall, "model_s": model,
                     "cycle_ms": 1e3 * wall / cycles, "overhead_ms": 1e3 * (wall - model) / cycles,
                     "overhead_share": (wall - model) / wall,
                     **{f"{key} ms": 1e3 * t / cycles for key, t in sorted(calls.items())}})
    # warmup: wall seconds (the prompt's prefills included) and those spent recording graphs or compiling
    return summarise(rows) | {"warmup_shapes": shapes, "warmup_s": warmup_s, "capture_s": spec.capture_seconds}


def run_hf(target, assistant, tok, tokens: int, k: int, device: str) -> dict:
    """The target's generate (assistant None) or transformers' assisted generation with K drafted every cycle."""
    kwargs = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    calls = {"n": 0}
    original = target.forward

    def counted(*args, **kw):
        calls["n"] += 1
        return original(*args, **kw)

    rows = []
    for i, prompt in enumerate([PROMPTS[0]] + PROMPTS):
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        target.forward = counted
        calls["n"] = 0
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                                  pad_token_id=tok.eos_token_id, **kwargs)
        sync(device)
        wall = time.perf_counter() - start
        target.forward = original
        if i:  # the first is a warm-up
            rows.append({"prompt": prompt, "tokens": out.shape[1] - ids.shape[1], "cycles": calls["n"],
                         "wall_s": wall, "cycle_ms": 1e3 * wall / calls["n"]})
    return summarise(rows)


def summarise(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k not in ("prompt",)]
    return {"rows": rows, **{f"median_{k}": statistics.median(r[k] for r in rows) for k in keys}}


def markdown(meta: dict, results: dict) -> str:
    lines = [f"GPU: {meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}; bf16 random "
             f"weights at the {meta['pair']} shapes with the fixture tokenizers' vocabularies; K = {meta['k']} fixed; "
             f"{meta['tokens']} new tokens x {len(PROMPTS)} prompts; medians over prompts.", "",
             "| system | cycles | proposals verified per cycle | ms per cycle | model calls ms per cycle | "
             "loop overhead ms per cycle | overhead share | cycles healed |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:200]} | | | | | | |")
        elif "median_overhead_ms" in r:
            lines.append(f"| {name} | {r['median_cycles']:.0f} | {r['median_nodes']:.1f} | {r['median_cycle_ms']:.2f} | "
                         f"{r['median_cycle_ms'] - r['median_overhead_ms']:.2f} | {r['median_overhead_ms']:.2f} | "
                         f"{100 * r['median_overhead_share']:.1f}% | {r.get('median_healed', 0):.0f} |")
        else:
            lines.append(f"| {name} | {r['median_cycles']:.0f} | | {r['median_cycle_ms']:.2f} | | | | |")
    lines += ["", "Model calls per cycle by kind (ms, medians over prompts):", ""]
    for name, r in results.items():
        split = {k[len("median_"):-3]: v for k, v in r.items() if k.startswith("median_") and k.endswith(" ms")}
        if split:
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="shrunken shapes (a smoke test on a CPU)")
    parser.add_argument("--pair", default="13b", choices=["13b", "7b-1b"])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--compile", nargs="?", const="inductor", default="off",
                        choices=["off", "graphs", "inductor", "auto"],
                        help="xtokspec's steps: off (eager on the static cache), graphs (CUDA graphs, recorded in "
                             "seconds), inductor (torch.compile, minutes at the 13B shapes; a bare --compile), or "
                             "auto (the default configuration's choice)")
    parser.add_argument("--tree-width", type=int, default=1,
                        help="token trees of this width (every drafted node verified: adaptive is off)")
    parser.add_argument("--drafts", nargs="+", default=["same", "bridged"], choices=["same", "bridged"],
                        help="which drafts run, in this order (a compiled run of both may not fit in one 10-minute "
                             "device call; the first system may pay for the GPU's warming up)")
    parser.add_argument("--unhealed", action="store_true",
                        help="beside the bridged chain, its twin with SpecConfig(draft_healing=False): what token "
                             "healing's host read per cycle costs the loop")
    parser.add_argument("--unhealed-first", action="store_true",
                        help="run the -unhealed twin before the healing system (the first system may pay for the "
                             "GPU's warming up)")
    args = parser.parse_args()
    import logging

    import transformers

    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("xtokspec").setLevel(logging.INFO)  # what compiles, and when

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, args.device)
    meta = {"device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "pair": args.pair,
            "k": args.k, "tokens": args.tokens, "tiny": args.tiny, "tree_width": args.tree_width,
            "compile": args.compile}
    target_config, draft_config = shapes(args.tiny)[args.pair]
    sp, bpe = tokenizer("ja-target"), tokenizer("ja-draft-bpe")
    torch.manual_seed(0)
    target = build(with_vocab(target_config, len(sp)), args.device, torch.bfloat16)
    no_eos(target, sp)
    results = {}

    def save():
        (out / "loop.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        (out / "loop.md").write_text(markdown(meta, results))

    results["target generate (transformers)"] = run_hf(target, None, sp, args.tokens, args.k, args.device)
    print("target alone:", results["target generate (transformers)"]["median_cycle_ms"], "ms per call", flush=True)
    save()
    for draft_name, draft_tok in [(name, {"same": sp, "bridged": bpe}[name]) for name in dict.fromkeys(args.drafts)]:
        draft = build(with_vocab(draft_config, len(draft_tok)), args.device, torch.bfloat16)
        no_eos(draft, draft_tok)
        tree = {"tree_width": args.tree_width}
        suffix = f" tree{args.tree_width}" if args.tree_width > 1 else ""
        if args.compile != "off":
            label = "compiled" if args.compile == "inductor" else args.compile
            configs = {f"{suffix} {label}": SpecConfig(adaptive=False, num_draft_tokens=args.k, cache="static",
                                                       compile=True if args.compile == "inductor" else args.compile,
                                                       **tree)}
        else:
            configs = {suffix: SpecConfig(adaptive=False, num_draft_tokens=args.k, compile=False, **tree)}
        if args.unhealed and draft_name == "bridged" and args.tree_width == 1:
            twins = {f"{name} unhealed": dataclasses.replace(config, draft_healing=False) for name, config in configs.items()}
            configs = twins | configs if args.unhealed_first else configs | twins
        for suffix, config in configs.items():
            name = f"xtokspec {draft_name}{suffix}"
            try:
                results[name] = run_xtokspec(XTokSpec((target, sp), (draft, draft_tok), config=config),
                                             args.tokens, args.device)
                print(name, {k: v for k, v in results[name].items() if k != "rows"}, flush=True)
            except Exception as error:  # one system failing must not lose the others' figures
                results[name] = {"error": repr(error)}
                print(name, "FAILED", repr(error), flush=True)
            save()
        if draft_name == "same" and args.tree_width == 1:
            results["assisted generation (transformers)"] = run_hf(target, draft, sp, args.tokens, args.k, args.device)
            print("assisted:", results["assisted generation (transformers)"]["median_cycle_ms"], flush=True)
            save()
        del draft
    save()
    print((out / "loop.md").read_text())


if __name__ == "__main__":
    main()
