"""Every prompt of fixtures/data/prompts.txt through the bundled pair with xtokspec's defaults, 64 new tokens: one
JSON line each (per-token acceptance, new tokens, stop reason, share of distinct 4-character pieces, text)."""

import json

from xtokspec import XTokSpec

spec = XTokSpec("ja-target", "ja-draft-bpe")
prompts = [p for p in open("fixtures/data/prompts.txt", encoding="utf-8").read().splitlines() if p]
for i, prompt in enumerate(prompts):
    result = spec.generate(prompt, max_new_tokens=64)
    text = result.text
    pieces = [text[j:j + 4] for j in range(max(0, len(text) - 3))]
    distinct = len(set(pieces)) / max(1, len(pieces))  # low: the output loops
    print(json.dumps(dict(i=i, prompt=prompt, acc=result.stats.token_acceptance, tokens=result.stats.new_tokens,
                          stop=result.stop_reason, distinct=round(distinct, 3), text=text), ensure_ascii=False),
          flush=True)
