"""Where a bridged cycle starts, and how often its first proposal is accepted there.

Each cycle starts where the committed text ends: at a target token boundary that falls either between two of the
draft's own tokens (its encoding of the whole final text: "aligned") or inside one of them ("inside": the target
ends "基本" where the draft writes "基本的な"). benchmarks/boundary_cuts.py measures the draft's first token at
every such boundary of reference text; this measures the cycles the decoder runs: greedy, the fallback off, token
healing off, the real preset's 6 prompts and 10 seeded held-out ones x 64 tokens. Per kind of cycle start: the
cycles, the share whose first proposal was accepted, and the per-token acceptance of those cycles. A run writes
OUT/<name>-<shard>.json (each cycle's committed ids, accepted count, proposals); --report reads them.

    python benchmarks/cycle_starts.py --draft base=~/.cache/xtokspec/real/gemma-3-270m --shard 0/2 --out DIR
    python benchmarks/cycle_starts.py --report --out DIR

Where the runs kept each cycle's proposals (`--healing` runs heal, as the decoder does by default), the report
also says where cycles stop (OUT/rejections.md): each proposal position's acceptance given the ones before it were
accepted, and of the rejected proposals, the share whose text the target wrote all the same, in other pieces (the
draft's text ends inside a longer target token: "を与" proposed where the target writes "を与え"), with how many of
those were a cycle's last proposal.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from common import write_manifest
from distill_agreement import held_out_prompts

from xtokspec import SpecConfig, XTokSpec
from xtokspec.cli.bench import REAL_PROMPTS
from xtokspec.cli.presets import real_model_dir
from xtokspec.decode import loop
from xtokspec.runtime.models import load

KINDS = ("first", "aligned", "inside")  # "first": the prompt's end (the first cycle)


def run(name: str, path: str, shard: str, out: Path, healing: bool = False) -> None:
    index, shards = (int(x) for x in shard.split("/"))
    target = load(str(real_model_dir("qwen2.5-coder-1.5b")), "target", dtype=torch.bfloat16)
    draft = load(str(Path(path).expanduser()), "draft", dtype=torch.bfloat16)
    spec = XTokSpec(target, draft, config=SpecConfig(fallback=False, draft_healing=healing))
    cycles = []
    commit = loop.commit

    def recorded(run, mapper, proposal, verdict, remaining):  # a drafted cycle's commit (chains: no trie)
        new_ids = commit(run, mapper, proposal, verdict, remaining)
        proposals = list(proposal.target_ids)
        cycles.append((new_ids, verdict.accepted, len(proposals), proposals))
        return new_ids

    loop.commit = recorded
    rows = []
    for prompt in (REAL_PROMPTS + held_out_prompts(0, 10))[index::shards]:
        cycles.clear()
        result = spec.generate(prompt, max_new_tokens=64)
        rows.append({"prompt": prompt, "out": result.token_ids, "cycles": list(cycles), "draft": path})
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out)
    (out / f"{name}-{index}.json").write_text(json.dumps(rows, ensure_ascii=False))


def report(out: Path) -> None:
    from transformers import AutoTokenizer

    from xtokspec.text.codec import TokenCodec

    t = TokenCodec(AutoTokenizer.from_pretrained(real_model_dir("qwen2.5-coder-1.5b")), name="target")
    codecs = {}  # a draft's folder -> its TokenCodec (runs that did not record their draft: Gemma-3's)

    def draft_codec(path: str | None) -> TokenCodec:
        path = str(Path(path).expanduser()) if path else str(real_model_dir("gemma-3-270m"))
        if path not in codecs:
            codecs[path] = TokenCodec(AutoTokenizer.from_pretrained(path), name="draft")
        return codecs[path]

    runs = defaultdict(list)  # name -> its rows, every shard's
    for f in sorted(out.glob("*-*.json")):  # NAME-SHARD.json
        runs[f.stem.rsplit("-", 1)[0]] += json.loads(f.read_text())
    lines = ["| draft | kind of cycle start | cycles | first proposal accepted | per-token acceptance |",
             "|---|---|---|---|---|"]
    summary = {}
    for name, rows in runs.items():
        stat = defaultdict(lambda: [0, 0, 0, 0])  # cycles, first accepted, accepted, proposals tested
        for row in rows:
            d = draft_codec(row.get("draft"))
            prompt = row["prompt"].encode()
            text = prompt + b"".join(t.token_bytes[i] for i in row["out"])
            _, ends = d.encode_stream(text.decode("utf-8", errors="ignore"))
            inside, start = set(), 0
            for end in ends:
                inside.update(range(start + 1, end))
                start = end
            pos = len(prompt)
            for n, (new_ids, accepted, depth, *_) in enumerate(row["cycles"]):
                kind = "first" if n == 0 else "inside" if pos in inside else "aligned"
                if depth >= 1:
                    s = stat[kind]
                    s[0] += 1
                    s[1] += accepted >= 1
                    s[2] += accepted
                    s[3] += accepted + (accepted < depth)  # a rejection tests one more proposal
                pos += sum(len(t.token_bytes[i]) for i in new_ids)
        summary[name] = {k: {"cycles": v[0], "first_accepted": v[1] / v[0], "acceptance": v[2] / v[3]}
                         for k, v in stat.items()}
        for kind in KINDS:
            if kind in summary[name]:
                s = summary[name][kind]
                lines.append(f"| {name} | {kind} | {s['cycles']} | {s['first_accepted']:.3f} | {s['acceptance']:.3f} |")
    (out / "cycle_starts.md").write_text("\n".join(lines) + "\n")
    (out / "cycle_starts.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    rejections(out, runs, t)


def rejections(out: Path, runs: dict[str, list], t) -> None:
    """Where cycles stop, for the runs that kept their proposals (name -> rows): OUT/rejections.md and .json."""
    lines = ["| draft | cycles | acceptance at proposal 1 / 2 / 3 / 4+ (given the ones before) | rejections at the "
             "first proposal | rejected text the target wrote in other pieces | ... at a cycle's last proposal |",
             "|---|---|---|---|---|---|"]
    summary = {}
    for name, rows in runs.items():
        reached, accepted_at = defaultdict(int), defaultdict(int)
        cycles = rejected = first = other = last = 0
        for row in rows:
            out_ids, at = row["out"], 0
            for new_ids, accepted, depth, *kept in row["cycles"]:
                if kept and depth >= 1:
                    proposals = kept[0]
                    cycles += 1
                    for j in range(min(accepted + 1, depth)):
                        reached[min(j, 3)] += 1
                        accepted_at[min(j, 3)] += j < accepted
                    if accepted < depth:
                        rejected += 1
                        first += accepted == 0
                        wrong = t.bytes_of(proposals[accepted:])
                        written = t.bytes_of(out_ids[at + accepted:])
                        n = min(len(wrong), len(written))
                        if wrong[:n] == written[:n]:  # the same text, split otherwise
                            other += 1
                            last += accepted == depth - 1
                at += len(new_ids)
        if not cycles:
            continue
        rates = [accepted_at[j] / reached[j] if reached[j] else None for j in range(4)]
        summary[name] = {"cycles": cycles, "rejections": rejected, "acceptance_by_position": rates,
                         "first_position_rejections": first, "same_text_other_pieces": other,
                         "same_text_at_last_proposal": last}
        shown = " / ".join("-" if r is None else f"{r:.3f}" for r in rates)
        lines.append(f"| {name} | {cycles} | {shown} | {first / rejected:.2f} ({first} of {rejected}) | "
                     f"{other / rejected:.3f} ({other}) | {last} |")
    if summary:
        (out / "rejections.md").write_text("\n".join(lines) + "\n")
        (out / "rejections.json").write_text(json.dumps(summary, indent=1))
        print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", metavar="NAME=PATH", help="a draft for Qwen2.5-Coder-1.5B (its tokenizer Gemma-3's)")
    parser.add_argument("--shard", default="0/1", metavar="I/N", help="only the prompts whose index is I modulo N")
    parser.add_argument("--healing", action="store_true", help="token healing on (the decoder's default)")
    parser.add_argument("--report", action="store_true", help="no run: the table over OUT's runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.report:
        return report(args.out)
    name, _, path = args.draft.partition("=")
    run(name, path, args.shard, args.out, args.healing)


if __name__ == "__main__":
    main()
