"""Where the greedy loop makes the host wait for the GPU: each synchronising call of one generation (CUDA's sync
debug mode), grouped by the xtokspec source line that made it. Run on a GPU: python benchmarks/gpu_syncs.py"""

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from xtokspec import SpecConfig, XTokSpec  # noqa: E402


def load(name):
    path = ROOT / "fixtures" / "models" / name
    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval(),
            AutoTokenizer.from_pretrained(path))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for draft in ("ja-draft-same", "ja-draft-bpe"):
        spec = XTokSpec(load("ja-target"), load(draft), config=SpecConfig(cache="static", adaptive=False, num_draft_tokens=4))
        spec.warmup("ファイルシステムをマウントするには", max_new_tokens=64, progress=False)  # graphs recorded now
        spec.generate("ファイルシステムをマウントするには", max_new_tokens=8)
        sites = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None, sites=sites):
            if "synchroniz" in str(message):
                ours = [f for f in traceback.extract_stack() if "/xtokspec/" in f.filename]
                sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in reversed(ours[-3:]))] += 1

        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            result = spec.generate("ファイルシステムをマウントするには", max_new_tokens=64)
            torch.cuda.set_sync_debug_mode(0)
        print(f"== {draft}: {sum(sites.values())} syncs, {result.stats.target_forwards} cycles")
        for site, n in sites.most_common():
            print(f"{n:4d}  {site}")


if __name__ == "__main__":
    main()
