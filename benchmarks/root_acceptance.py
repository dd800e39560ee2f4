"""How often a cycle's first target token is accepted, under each way of proposing it, along the target's own
sampled continuations (offline: no speculative loop runs).

For each prompt the target samples a continuation; at each of its positions whose committed text is whole
characters, the draft reads the same text. From the target's distribution p there and the draft's q (both
warped with the same temperature, as the loop warps them), this computes the chance that the first proposal
is accepted:

- `onehot`: a draft id drawn from q, proposed as the first target token of its text: sum_d q(d) p(fp(d));
- `intersection`: the draft's mass on ids whose bytes equal a target token: sum min(p, Q_map);
- `top-m`: a tree root with the draft's m likeliest candidates (grouped by first target token), one-hot rule:
  their target mass p(c_1) + ... + p(c_m);
- `sampled-m`: a tree root whose m candidates are drawn from Q = q grouped by first target token, without
  replacement, and tested against it (SpecConfig(tree_root="sampled")): 1 - prod_j (1 - min(1, p_j/q_j)),
  averaged over --draws draws made with xtokspec's own functions (a Monte Carlo estimate; the standard error
  over positions is printed beside each mean);
- `target top-4 mass`: what the target's own 4 likeliest tokens hold (how flat the target is).

    python benchmarks/root_acceptance.py --preset fixtures --temperature 0.7
    python benchmarks/root_acceptance.py --preset real --temperature 0.7   (after benchmarks/real_models.py)

Writes --out/root_acceptance-<preset>-T<temperature>.json (every position's figures) and prints a Markdown row.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from common import write_manifest
from tqdm.auto import tqdm

from xtokspec import XTokSpec
from xtokspec.cli.bench import REAL_PROMPTS
from xtokspec.cli.presets import load_preset
from xtokspec.decode import sampling, tree
from xtokspec.runtime.models import fixtures_dir
from xtokspec.types import SamplingParams

WIDTHS = (1, 2, 4, 8)


def sampled_acceptance(p: torch.Tensor, draft_probs: torch.Tensor, groups: torch.Tensor, root_q: torch.Tensor,
                       width: int, draws: int, gen: torch.Generator) -> float:
    """Mean over `draws` draws of the chance that a sampled root of `width` candidates accepts one."""
    total = 0.0
    for _ in range(draws):
        noise = sampling.exponential_noise(draft_probs.shape, gen, draft_probs.device)
        children, _ = sampling.draw_groups_without_replacement(draft_probs, groups, p.shape[-1], width, noise)
        tests, _ = tree.sampled_tests(p, root_q, children)
        reject = 1.0
        for p_j, q_j in tests.tolist():
            reject *= 1.0 - min(1.0, p_j / q_j)
        total += 1.0 - reject
    return total / draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("fixtures", "real"), default="fixtures")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--prompts", type=int, default=12, help="fixture prompts (the real preset has 6)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--draws", type=int, default=200, help="draws per position for the sampled-m estimates")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/local/root-acceptance")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.preset == "real" else torch.float32
    models = load_preset(args.preset, dtype)
    spec = XTokSpec(models.target, models.draft_cross)
    if args.preset == "real":
        prompts = REAL_PROMPTS
    else:
        lines = (fixtures_dir() / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
        prompts = [p for p in lines if p][: args.prompts]
    warpers = sampling.build_warpers(SamplingParams(do_sample=True, temperature=args.temperature))
    maps = spec.vocab_maps
    first_pieces = maps.first_pieces
    groups = maps.root_groups(spec.same_vocab, spec.target_model.config.vocab_size, spec.draft_model.config.vocab_size)
    token_map = maps.draft_to_target(torch.device("cpu"))
    target_vocab = spec.target_model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for n, prompt in enumerate(tqdm(prompts, desc="prompts")):
            ids = spec.target.encode_prompt(prompt)
            torch.manual_seed(n)
            inputs = torch.tensor([ids])
            out = spec.target_model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=True,
                                             temperature=args.temperature, top_k=0, top_p=1.0,
                                             max_new_tokens=args.new_tokens)
            continuation = out[0, len(ids):].tolist()
            target_probs = sampling.logits_to_probs(spec.target_model(out).logits[0, len(ids) - 1:], warpers)
            for t in range(len(continuation)):
                try:
                    text = spec.target.bytes_of(continuation[:t]).decode("utf-8")
                except UnicodeDecodeError:
                    continue  # an incomplete character is pending: a tree's root takes the top candidates there
                if t and continuation[t - 1] in spec.target_eos:
                    break
                draft_ids = spec.draft.encode_prompt(prompt + text)
                logits = spec.draft_model(torch.tensor([draft_ids])).logits[0, -1:]
                q = sampling.logits_to_probs(logits, warpers)[0]  # (Vd,)
                p = target_probs[t]  # (Vt,)
                root_q = sampling.grouped_distribution(q, groups, target_vocab)  # (Vt,)
                mapped = sampling.map_to_target(q[None], token_map, target_vocab)[0] if bool(
                    (q * (token_map >= 0)).sum() > 0) else torch.zeros_like(p)
                order = torch.argsort(root_q, descending=True)
                row = {"prompt": n, "position": t,
                       "onehot": float((q * p[first_pieces.clamp(min=0)] * (first_pieces >= 0)).sum()),
                       "intersection": float(torch.minimum(p, mapped).sum()),
                       "target top-4 mass": float(p.topk(4).values.sum())}
                for m in WIDTHS:
                    row[f"top-{m}"] = float(p[order[:m]].sum())
                    row[f"sampled-{m}"] = sampled_acceptance(p, q, groups, root_q, m, args.draws, gen)
                rows.append(row)
    keys = [k for k in rows[0] if k not in ("prompt", "position")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(out_dir)
    path = out_dir / f"root_acceptance-{args.preset}-T{args.temperature}.json"
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"{args.preset}, T={args.temperature}: {len(rows)} positions of {len(prompts)} prompts ({path})")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    cells = []
    for k in keys:
        v = np.array([r[k] for r in rows])
        cells.append(f"{v.mean():.3f} ({v.std() / math.sqrt(len(v)):.3f})")
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
