"""int8 weight scales for a trimmed draft: one per matrix (torch's default dynamic qconfig) or one per output row
(per-channel, `runtime.models.int8_linears`), the trimmed head in int8 either way or left in float32: how often
each variant's greedy choice is the float32 draft's (24 held-out lines read one id a step, as `draft_step.py`),
and its step at 1 and 8 requests (the best of three, variants timed in turn twice: this VM's speed drifts by a
fifth over minutes).

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/results/epyc-avx2/vllm-adaptive/int8/scales.py > output-scales.txt
"""

import copy
import sys
import warnings
from pathlib import Path

import torch
from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_step import agreement, step_ms  # noqa: E402
from real_models import real_model_dir  # noqa: E402

from xtokspec.runtime.vocab import TrimmedHead, trimmed_draft  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.backends.quantized.engine = "x86"
QCONFIG = {"matrix": default_dynamic_qconfig, "row": per_channel_dynamic_qconfig}
VARIANTS = (("matrix", "matrix"), ("matrix", "float32"), ("row", "row"), ("row", "float32"), ("row", "matrix"))


def variant(model, body: str, head: str):
    """A copy of `model` with its linears' weights in int8 (`body`: one scale per matrix or per row) and its
    trimmed head so too, or left in float32."""
    quantized = copy.deepcopy(model)
    quantize_dynamic(quantized, {torch.nn.Linear: QCONFIG[body]}, dtype=torch.qint8, inplace=True)
    for module in quantized.modules():
        if isinstance(module, TrimmedHead) and head != "float32":
            module.quantize(QCONFIG[head])
    return quantized


lines = [x for x in (ROOT / "fixtures" / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines() if x][:24]
path = real_model_dir("gemma-3-270m")
model = trimmed_draft(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), torch.arange(32768))
tokenizer = AutoTokenizer.from_pretrained(path)
built = {v: variant(model, *v) for v in VARIANTS}
times = {v: [] for v in VARIANTS}
for _ in range(2):
    for v in VARIANTS:
        times[v].append((step_ms(built[v], 1, 20), step_ms(built[v], 8, 20)))
print("Gemma-3-270M, head trimmed to 32,768 ids; weight scales per matrix or per output row")
for v in VARIANTS:
    ones, eights = [t[0] for t in times[v]], [t[1] for t in times[v]]
    print(f"body {v[0]:6s} head {v[1]:7s}: step {min(ones):.1f} ms at 1 request ({max(ones):.1f} in the other pass), "
          f"{min(eights):.1f} ms at 8 ({max(eights):.1f}); greedy choice the float32 one's at "
          f"{agreement(model, built[v], tokenizer, lines):.1%} of positions", flush=True)
