"""Token-map coverage of a draft/target pair: what `proposal="intersection"` can move, and what raw-string
matching (transformers' Universal Assisted Generation sampler) would find instead.

Figures, written to benchmarks/results/local/<preset>/token_map.json and printed as Markdown:
- share of the draft's regular tokens whose bytes equal some target token's bytes, and the share of the
  target's regular tokens they reach (xtokspec's byte-normalized map);
- the same two shares for transformers' own AssistantToTargetTranslator (raw vocabulary strings, the
  leading space marker swapped), and how many of its matches contain Japanese (kana or CJK) characters,
  against how many target tokens do;
- the draft's probability mass on mapped tokens along its own sampled continuations of held-out prompts
  (transformers' default top-k 50), per temperature: the part of the draft distribution intersection keeps.

Run: ``python benchmarks/token_map.py`` (fixtures) or ``python benchmarks/token_map.py --preset real``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from transformers.generation.candidate_generator import AssistantToTargetTranslator

from xtokspec import XTokSpec
from xtokspec.cli.bench import REAL_PROMPTS
from xtokspec.cli.presets import load_preset
from xtokspec.decode import sampling
from xtokspec.runtime.models import fixtures_dir
from xtokspec.types import SamplingParams

JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u9fff]")
TEMPERATURES = (0.3, 0.7, 1.0)
NEW_TOKENS = 48


def japanese_tokens(tokenizer, ids) -> int:
    return sum(bool(JAPANESE.search(tokenizer.decode([i]))) for i in ids)


@torch.no_grad()
def mapped_mass(model, tokenizer, mapped: torch.Tensor, prompts: list[str], temperature: float) -> float:
    """Mean probability the draft puts on mapped ids along its own sampled continuations."""
    warpers = sampling.build_warpers(SamplingParams(do_sample=True, temperature=temperature, top_k=50))
    torch.manual_seed(0)
    total, positions = 0.0, 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        seq = model.generate(input_ids=ids, do_sample=True, temperature=temperature, top_k=50, top_p=1.0,
                             max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)  # (1, T)
        logits = model(input_ids=seq).logits[0, ids.shape[1] - 1 : -1]  # (n, V): rows that drew new tokens
        probs = sampling.logits_to_probs(logits, warpers)  # (n, V)
        total += probs[:, : mapped.shape[0]][:, mapped].sum().item()
        positions += probs.shape[0]
    return total / positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("fixtures", "real"), default="fixtures")
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = load_preset(args.preset, torch.float32 if args.preset == "fixtures" else torch.bfloat16)
    (t_model, t_tok), (d_model, d_tok) = models.target, models.draft_cross
    if args.preset == "fixtures":
        prompts = [p for p in (fixtures_dir() / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines() if p]
    else:
        prompts = REAL_PROMPTS
    prompts = prompts[: args.prompts]

    spec = XTokSpec(models.target, models.draft_cross)
    token_map = spec.vocab_maps.token_map
    ours = torch.tensor(token_map.draft_to_target)
    target_regular = [i for i, b in enumerate(spec.target.token_bytes) if b]
    hf = AssistantToTargetTranslator(t_tok, d_tok, t_model.config.vocab_size)
    hf_targets = sorted(set(hf.target_to_assistant_input_ids))
    figures = {
        "draft": d_model.config.name_or_path, "target": t_model.config.name_or_path,
        "xtokspec_mapped_draft_share": token_map.mapped_draft_share,
        "xtokspec_mapped_target_share": token_map.mapped_target_share,
        "xtokspec_japanese_targets_reached": japanese_tokens(t_tok, sorted({int(t) for t in ours if t >= 0})),
        "raw_string_matches": len(hf_targets),
        "raw_string_japanese_matches": japanese_tokens(t_tok, hf_targets),
        "target_japanese_tokens": japanese_tokens(t_tok, target_regular),
        "draft_mass_on_mapped": {str(t): mapped_mass(d_model, d_tok, ours >= 0, prompts, t) for t in TEMPERATURES},
        "prompts": len(prompts), "new_tokens": NEW_TOKENS,
    }
    out = Path(__file__).resolve().parent / "results" / "local" / args.preset / "token_map.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
    f = figures
    print(f"| figure | {args.preset} |\n|---|---|")
    print(f"| draft tokens with a same-bytes target token (xtokspec) | {f['xtokspec_mapped_draft_share']:.1%} |")
    print(f"| target tokens they reach | {f['xtokspec_mapped_target_share']:.1%} |")
    print(f"| ... of which Japanese | {f['xtokspec_japanese_targets_reached']} of {f['target_japanese_tokens']} |")
    print(f"| target tokens matched by raw strings (transformers) | {f['raw_string_matches']} "
          f"({f['raw_string_japanese_matches']} Japanese) |")
    print("| draft mass on mapped tokens, T = " + " / ".join(f["draft_mass_on_mapped"]) + " | "
          + " / ".join(f"{v:.2f}" for v in f["draft_mass_on_mapped"].values()) + " |")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
