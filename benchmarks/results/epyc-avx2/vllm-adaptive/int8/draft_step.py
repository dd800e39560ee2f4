"""What a draft's step costs in float32 and with its linears in int8 (`xtokspec_draft_linears="int8"`,
`runtime.models.int8_linears`): one forward of one new id over a 40-id cache, at 1 and 8 requests, the best of three
repetitions; the real drafts' heads trimmed to 32,768 ids as the bench's (`xtokspec_draft_vocab_text`; which ids
does not change the cost), the fixture draft's left whole. Also how often the int8 draft's greedy choice is the
float32 one's, reading 24 held-out lines one id a step.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/results/epyc-avx2/vllm-adaptive/int8/draft_step.py > output-draft-step.txt

(`output-draft-step.txt` was written at d3b223c, when `int8_linears` used one weight scale per matrix; it uses one
per row since 4eb5cf9: `scales.py` compares both.)
"""

import copy
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from real_models import real_model_dir  # noqa: E402

from xtokspec.runtime.models import fixture_model, int8_linears  # noqa: E402
from xtokspec.runtime.vocab import trimmed_draft  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def step_ms(model, rows: int, n: int) -> float:
    ids = torch.randint(100, 8000, (rows, 40), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = torch.full((rows, 1), 500)
            model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            start = time.perf_counter()
            for _ in range(n):
                model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache.crop(-1)  # back to 41 positions
            best = min(best, (time.perf_counter() - start) / n)
    return best * 1e3


def agreement(model, quantized, tokenizer, lines: list[str]) -> float:
    """The share of positions where both drafts' greedy choice is the same, reading each line one id a step as a
    draft does (a forward over many positions would quantize their activations with one scale)."""
    same = total = 0
    with torch.inference_mode():
        for line in lines:
            ids = tokenizer(line)["input_ids"]
            caches = [DynamicCache(config=m.config) for m in (model, quantized)]
            for token in ids:
                a, b = (m(input_ids=torch.tensor([[token]]), past_key_values=c, use_cache=True).logits[0, -1].argmax()
                        for m, c in zip((model, quantized), caches, strict=True))
                same += int(a == b)
                total += 1
    return same / total


def main() -> None:
    lines = [x for x in (ROOT / "fixtures" / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines() if x][:24]
    for name, path, trim in (("fixture ja-draft-bpe", fixture_model("ja-draft-bpe"), False),
                             ("Gemma-3-270M", real_model_dir("gemma-3-270m"), True),
                             ("SmolLM2-135M", real_model_dir("smollm2-135m"), True)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        vocab = model.config.get_text_config().vocab_size
        if trim and vocab > 32768:
            model = trimmed_draft(model, torch.arange(32768))
        quantized = copy.deepcopy(model)
        int8_linears(quantized)
        n = 200 if "fixture" in name else 20
        times = {(kind, rows): step_ms(m, rows, n) for kind, m in (("float32", model), ("int8", quantized))
                 for rows in (1, 8)}
        print(f"{name}{' (head trimmed to 32,768 ids)' if trim and vocab > 32768 else ''}: one step "
              f"{times['float32', 1]:.1f} ms float32, {times['int8', 1]:.1f} ms int8 at 1 request; "
              f"{times['float32', 8]:.1f} / {times['int8', 8]:.1f} ms at 8; greedy choice the float32 one's at "
              f"{agreement(model, quantized, tokenizer, lines):.1%} of {len(lines)} held-out lines' positions, read one id a step", flush=True)


if __name__ == "__main__":
    main()
