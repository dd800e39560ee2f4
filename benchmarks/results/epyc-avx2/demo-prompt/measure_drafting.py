"""The candidates of measure_defaults.py's output again, drafting every cycle (no fallback), 128 new tokens."""

import warnings

from xtokspec import SpecConfig, XTokSpec

warnings.simplefilter("ignore")
spec = XTokSpec("ja-target", "ja-draft-bpe", config=SpecConfig(fallback=False))
prompts = [p for p in open("fixtures/data/prompts.txt", encoding="utf-8").read().splitlines() if p]
for i in [63, 29, 44, 4, 0, 30, 34, 13, 9, 39, 40, 62, 10]:
    result = spec.generate(prompts[i], max_new_tokens=128)
    stats = result.stats
    print(i, round(stats.token_acceptance, 3), stats.new_tokens, float(stats.new_tokens), result.stop_reason,
          prompts[i], "|", result.text)
