"""The bundled model names work wherever xtokspec is installed, from the package's own data, with no checkout
and no environment variable.

Under tox (`package = wheel`) the installed xtokspec is already a wheel's; in a development venv (an editable
install, whose code is the checkout) a wheel is built from a copy of the sources and installed into a folder
of its own. Either way a fresh interpreter (`python -I`, no XTOKSPEC_FIXTURES) started in an empty folder runs
`xtokspec generate` with the bundled names, and what it prints is compared with the target alone's own greedy
continuation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from model_helpers import MODELS, ROOT

from xtokspec.runtime.models import FIXTURE_NAMES

PROMPT = "表計算ドキュメントのセル範囲は、"
NEW_TOKENS = 24
RUN = """
import sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
import xtokspec, xtokspec.runtime.models
from xtokspec.cli.main import main
print("PACKAGE", xtokspec.__file__, file=sys.stderr)
print("FIXTURES", xtokspec.runtime.models.fixtures_dir(), file=sys.stderr, flush=True)
sys.exit(main(["generate", *sys.argv[2:]]))
"""


def _build_and_install(tmp: Path) -> Path:
    """A wheel built from a copy of the checkout's sources, installed with --target; the install folder."""
    pytest.importorskip("setuptools", reason="building a wheel without build isolation needs setuptools here")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "work")
    shutil.copytree(ROOT / "xtokspec", src / "xtokspec", ignore=skip)
    shutil.copytree(ROOT / "fixtures", src / "fixtures", ignore=skip)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
                    str(src)], check=True, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("xtokspec-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True,
                   cwd=tmp)
    return site


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path | None]:
    """(the installed xtokspec package folder, the folder to put on sys.path or None for the environment's)."""
    package = Path(importlib.util.find_spec("xtokspec").origin).resolve().parent
    if package != ROOT / "xtokspec":  # a wheel installed in this environment (tox's, under .tox/)
        return package, None
    site = _build_and_install(tmp_path_factory.mktemp("wheel"))
    return site / "xtokspec", site


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_package_data_holds_the_bundled_models(installed):
    package, _ = installed
    fixtures = package / "fixtures"
    for name in FIXTURE_NAMES:
        for file in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (fixtures / "models" / name / file).is_file(), f"{name}/{file} is not installed"
        weights = fixtures / "models" / name / "model.safetensors"
        assert _sha256(weights) == _sha256(MODELS / name / "model.safetensors"), f"{name}: not the checkout's weights"
    assert (fixtures / "data" / "prompts.txt").is_file() and (fixtures / "data" / "heldout.txt").is_file()
    files = [p for p in fixtures.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix == ".py"], "the fixtures' build scripts are not package data"
    assert not (fixtures / "tokenizers").exists() and not (fixtures / "work").exists()
    size = sum(p.stat().st_size for p in files)
    assert size < 25 * 2**20, f"installed fixtures take {size / 2**20:.1f} MiB"


@pytest.mark.slow
def test_bundled_names_run_outside_the_checkout(installed, tmp_path):
    import torch
    from model_helpers import load_fixture_model

    package, site = installed
    env = {k: v for k, v in os.environ.items() if k != "XTOKSPEC_FIXTURES"}
    env["OMP_NUM_THREADS"] = "1"
    args = [PROMPT, "--target", "ja-target", "--draft", "ja-draft-bpe", "--dtype", "float32",
            "--max-new-tokens", str(NEW_TOKENS)]
    done = subprocess.run([sys.executable, "-I", "-c", RUN, str(site or ""), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert f"PACKAGE {package / '__init__.py'}" in lines, done.stderr[:500]
    assert f"FIXTURES {package / 'fixtures'}" in lines, done.stderr[:500]
    assert "stopped:" in done.stderr

    model, tokenizer = load_fixture_model("ja-target")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.strip(), "the target wrote nothing: the comparison would prove nothing"
    assert done.stdout.strip() == expected.strip()
