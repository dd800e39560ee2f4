"""How well a bridged draft continues text that ends inside one of its own tokens.

Each bridged cycle starts where the target's last token ended. Where that point falls inside a token the draft's
tokenizer would write there (the target ends "ファイ", the draft writes "ファイル" as one token), the draft reads a
context its training never showed it (a short last piece where the whole token belongs) and must go on from the
middle of a token. This measures, on the target's greedy continuations of held-out prompts (distill_agreement.py's
references.jsonl), at every target-token boundary of the continuation: the draft reads the text up to there (its
tokenizer's encoding of it, as the bridge hands it over) and drafts its argmax token; right when that token's text
starts the true rest of the text (or the rest, near the end, starts with it). Split by whether the boundary is a
token boundary in the draft's encoding of the whole text ("aligned") or inside one of those tokens ("inside").

    python benchmarks/boundary_cuts.py --draft ~/.cache/xtokspec/real/gemma-3-270m \\
        --target-tokenizer ~/.cache/xtokspec/real/qwen2.5-coder-1.5b \\
        --references benchmarks/results/epyc-avx512bf16/distill/agreement-gemma/references.jsonl --prompts 64 --out FILE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from xtokspec.runtime.models import load


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target-tokenizer", required=True)
    parser.add_argument("--references", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = [json.loads(line) for line in args.references.read_text(encoding="utf-8").splitlines()][: args.prompts]
    target_tokenizer = AutoTokenizer.from_pretrained(args.target_tokenizer)
    model, tokenizer = load(args.draft, "draft", dtype=getattr(torch, args.dtype))
    counts = {"aligned": [0, 0], "inside": [0, 0]}
    for record in records:
        text, start = record["prompt"] + record["continuation"], len(record["prompt"])
        cuts = [a for a, _ in target_tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
                ["offset_mapping"] if a > start]
        draft_starts = {a for a, b in tokenizer(text, return_offsets_mapping=True)["offset_mapping"] if b > a}
        for cut in cuts:
            ids = tokenizer(text[:cut], return_tensors="pt").input_ids.to(model.device)
            piece = tokenizer.decode([int(model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax())])
            rest = text[cut:]
            right = bool(piece) and (rest.startswith(piece) or piece.startswith(rest))
            kind = "aligned" if cut in draft_starts else "inside"
            counts[kind][0] += right
            counts[kind][1] += 1
    total = sum(n for _, n in counts.values())
    result = {"draft": args.draft, "target_tokenizer": args.target_tokenizer, "prompts": len(records),
              "boundaries": total, "dtype": args.dtype,
              **{kind: {"right": r, "boundaries": n, "share_right": r / max(1, n), "share_of_boundaries": n / max(1, total)}
                 for kind, (r, n) in counts.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    for kind in counts:
        print(f"{kind}: {result[kind]['boundaries']} boundaries ({result[kind]['share_of_boundaries']:.0%}), "
              f"first draft token right {result[kind]['share_right']:.3f}")


if __name__ == "__main__":
    main()
