"""`xtokspec generate` on the bundled fixtures: the README's main-job command."""

from __future__ import annotations

import pytest

from xtokspec.cli.main import main


@pytest.mark.slow
def test_generate_prints_continuation_and_stats(capsys, ja_target):
    assert main(["generate", "自然言語処理とは何か", "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert out.strip(), "no continuation printed"
    assert "tokens/call" in err and "accepted" in err


@pytest.mark.slow
def test_stream_and_sampling_flags(capsys, ja_target):
    assert main(["generate", "設定ファイル", "--max-new-tokens", "16", "--stream", "--sample", "--seed", "3",
                 "--temperature", "0.8", "--top-k", "20"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and ("intersection" in err or "onehot" in err)


@pytest.mark.slow
def test_generate_with_a_token_tree_gives_the_same_text(capsys, ja_target):
    args = ["generate", "自然言語処理とは何か", "--max-new-tokens", "24", "--dtype", "float32"]  # float32: no bf16 near-ties
    assert main(args) == 0
    chain = capsys.readouterr().out
    assert main([*args, "--tree-width", "4"]) == 0
    out, err = capsys.readouterr()
    assert out == chain and "greedy-bridge tree:" in err


@pytest.mark.slow
def test_generate_with_a_trimmed_draft_head_gives_the_same_text(capsys, ja_target):
    from model_helpers import FIXTURES

    args = ["generate", "自然言語処理とは何か", "--max-new-tokens", "24", "--dtype", "float32"]  # float32: a bf16 near-tie could part the two
    assert main(args) == 0
    full = capsys.readouterr().out
    assert main([*args, "--draft-vocab", "2048", "--calibration", str(FIXTURES / "data" / "heldout.txt")]) == 0
    out, err = capsys.readouterr()
    assert out == full and "draft head trimmed to 2048 of 8192 ids" in err and "[head: 2048 of 8192 ids]" in err


@pytest.mark.slow
def test_generate_with_onednn_linears(capsys, ja_target):
    """--cpu-linears onednn converts both models; the text is the converted target's, which on these fixtures
    (float32) is the unconverted one's too unless a near-tie parts them (test_onednn checks the tokens)."""
    args = ["generate", "自然言語処理とは何か", "--max-new-tokens", "24", "--dtype", "float32"]
    assert main(args) == 0
    torch_text = capsys.readouterr().out
    assert main([*args, "--cpu-linears", "onednn"]) == 0
    out, err = capsys.readouterr()
    assert "oneDNN linears: 169 in the target, 9 in the draft" in err and out == torch_text


def test_bad_input_exits_2_with_a_message(capsys):
    assert main(["generate", "", "--max-new-tokens", "4"]) == 2
    assert "xtokspec: error: prompt is empty" in capsys.readouterr().err


def test_version_and_no_stub_command(capsys):
    """`xtokspec --version` prints the package's version (pyproject's); the top-level help lists only the commands
    that do something (no `fetch`: the real preset's fetch script is benchmarks/real_models.py)."""
    import pathlib
    import re

    import xtokspec

    pyproject = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    assert f'\nversion = "{xtokspec.__version__}"\n' in pyproject, re.findall(r"\nversion = .*", pyproject)
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"xtokspec {xtokspec.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "generate" in out and "bench" in out and "fetch" not in out
    with pytest.raises(SystemExit) as exit_:
        main(["fetch"])
    assert exit_.value.code == 2 and "invalid choice: 'fetch'" in capsys.readouterr().err


# ---------------------------------------------------------------- a new user's first ten minutes
class _NoModels:
    """Stands in for XTokSpec: records what the CLI asked for; loading it at all can be made an error."""

    calls: list = []
    configs: list = []
    forbid = False

    def __init__(self, large, small, **kwargs):
        if _NoModels.forbid:
            raise AssertionError("models were loaded before the input was checked")
        self.large, self.small = large, small
        _NoModels.configs.append(kwargs.get("config"))

    def describe(self):
        return "target (fake); draft (fake)"

    def generate(self, prompt, **kwargs):
        from xtokspec.types import GenerationResult, GenerationStats

        _NoModels.calls.append((prompt, kwargs))
        return GenerationResult(text="ok", token_ids=[1], stats=GenerationStats(stop_reason="length"),
                                stop_reason="length")


@pytest.fixture
def no_models(monkeypatch):
    import xtokspec.spec

    monkeypatch.setattr(xtokspec.spec, "XTokSpec", _NoModels)
    _NoModels.calls, _NoModels.configs, _NoModels.forbid = [], [], False
    return _NoModels


@pytest.mark.parametrize(
    "args,message",
    [
        (["", "--max-new-tokens", "4"], "prompt is empty"),
        (["東京", "--top-k", "-1"], "top_k must be an integer >= 0"),
        (["東京", "--temperature", "-1"], "temperature must be >= 0"),
        (["東京", "--top-p", "0"], r"top_p must be in (0, 1]"),
        (["東京", "--sample", "--temperature", "0"], "temperature 0 means greedy decoding"),
        (["東京", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (["東京\ud800"], "lone surrogate"),
        ([], "no prompt: give it as an argument, '-' to read stdin, or --prompt-file"),
        (["東京", "--prompt-file", "x.txt"], "either as an argument or with --prompt-file, not both"),
        (["--prompt-file", "/no/such/prompt.txt"], "cannot read --prompt-file"),
        (["東京", "--draft-vocab", "2048"], "--draft-vocab needs --calibration FILE"),
        (["東京", "--draft-vocab", "0", "--calibration", "x.txt"], "--draft-vocab must be a positive integer"),
        (["東京", "--calibration", "x.txt"], "give --draft-vocab too"),
        (["東京", "--draft-vocab", "2048", "--calibration", "/no/such/text.txt"], "cannot read --calibration"),
        (["東京", "--tree-width", "0"], "tree_width must be an integer >= 1"),
        (["東京", "--compile", "--cache", "dynamic"], "compile=True needs the static cache"),  # SpecConfig's check
        (["東京", "--cpu-linears", "onednn"], "--cpu-linears onednn needs --dtype float32 and no --compile"),
        (["東京", "--cpu-linears", "onednn", "--dtype", "float32", "--compile"], "needs --dtype float32 and no --compile"),
        # a mistyped model, the draft's too, is named before the target loads
        (["東京", "--draft", "models/ja-dratf-bpe"], "draft (small): no model folder 'models/ja-dratf-bpe'; did you "
         "mean the bundled 'ja-draft-bpe'?"),
        (["東京", "--target", "fixtures/models/ja-targt"], "target (large): no such model folder: "
         "'fixtures/models/ja-targt' (did you mean 'fixtures/models/ja-target'?)"),
    ],
)
def test_bad_input_is_named_before_any_model_loads(no_models, capsys, args, message):
    no_models.forbid = True
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert "xtokspec: error:" in err and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "flags,do_sample,note",
    [
        ([], None, None),  # the target's generation_config decides (greedy for the bundled models)
        (["--temperature", "0"], False, "temperature 0: greedy decoding"),
        (["--temperature", "0.7"], True, "--temperature implies --sample"),
        (["--top-k", "20", "--top-p", "0.9"], True, "--top-k and --top-p imply --sample"),
        (["--sample"], True, None),
    ],
)
def test_sampling_flags_imply_sample_and_temperature_zero_is_greedy(no_models, capsys, flags, do_sample, note):
    assert main(["generate", "東京", *flags]) == 0
    (_prompt, kwargs), = no_models.calls
    assert kwargs["do_sample"] is do_sample
    err = capsys.readouterr().err
    assert (note in err) if note else ("note:" not in err), err


def test_tree_cache_and_compile_options_reach_the_config(no_models):
    assert main(["generate", "東京", "--tree-width", "4", "--cache", "static", "--compile"]) == 0
    (config,) = no_models.configs
    assert (config.tree_width, config.cache, config.compile) == (4, "static", True)
    assert main(["generate", "東京"]) == 0  # the defaults are SpecConfig's
    assert (no_models.configs[-1].tree_width, no_models.configs[-1].cache, no_models.configs[-1].compile) == (1, "auto", "auto")
    assert no_models.configs[-1].draft_healing
    assert main(["generate", "東京", "--no-healing"]) == 0 and not no_models.configs[-1].draft_healing
    for word, value in [("graphs", "graphs"), ("inductor", "inductor"), ("off", False), ("auto", "auto")]:
        assert main(["generate", "東京", "--compile", word]) == 0
        compile_ = no_models.configs[-1].compile
        assert compile_ == value and type(compile_) is type(value), (word, compile_)


def test_prompt_from_stdin_and_from_a_file(no_models, monkeypatch, tmp_path):
    import io

    long_prompt = "ファイルシステムの設定。" * 20_000  # 240k characters: too long for an argument list
    monkeypatch.setattr("sys.stdin", io.StringIO(long_prompt + "\n"))
    assert main(["generate", "-"]) == 0
    path = tmp_path / "prompt.txt"
    path.write_text("設定ファイル\n", encoding="utf-8")
    assert main(["generate", "--prompt-file", str(path)]) == 0
    assert [prompt for prompt, _ in no_models.calls] == [long_prompt, "設定ファイル"]


def test_bundled_names_are_the_defaults(no_models):
    import xtokspec.spec

    seen = {}
    real_init = _NoModels.__init__

    def record(self, large, small, **kwargs):
        seen.update(large=large, small=small, dtype=kwargs["large_kwargs"]["dtype"])
        real_init(self, large, small, **kwargs)

    xtokspec.spec.XTokSpec.__init__ = record
    try:
        assert main(["generate", "東京"]) == 0
    finally:
        _NoModels.__init__ = real_init
    assert seen == {"large": "ja-target", "small": "ja-draft-bpe", "dtype": "auto"}


def test_every_option_has_help_and_shows_its_default(capsys):
    from xtokspec.cli.main import build_parser

    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    missing = [a.dest for a in generate._actions if not a.help]
    assert not missing, f"options without help text: {missing}"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: ja-target)" in out and "(default: auto)" in out and "(default: 128)" in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_bench_help_describes_every_option(capsys):
    """`xtokspec bench --help`: a description, help on every option with its default, the --modes syntax."""
    from xtokspec.cli.main import build_parser

    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]
    missing = [a.dest for a in bench._actions if not a.help]
    assert not missing, f"options without help text: {missing}"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Benchmark xtokspec against the target alone" in out
    assert "(default: fixtures)" in out and "(default: 128)" in out and "(default: float32)" in out
    assert "greedy, or T=<temperature>" in out and "--modes greedy T=0.7 T=1.0" in out
    assert "(default: None)" not in out and "(default: False)" not in out and "(default: [])" not in out
    assert parser.parse_args(["bench", "--modes", "greedy", "T=0.7"]).modes == ["greedy", "T=0.7"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--modes", "T0.7"])
    assert "'T0.7': a mode is greedy or T=<temperature>" in capsys.readouterr().err


def test_seed_help_states_when_a_sample_repeats(capsys):
    from xtokspec.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "same seed, same output" not in out
    assert "Without it, the same seed gives the same output when the drafted cycles are the same, as with --fixed-k" in out
    assert "With --keyed the same seed gives the same text whatever the draft" in out


@pytest.mark.fallback  # NOTE: the real fallback policy, which adaptive=False turns off
def test_same_seed_same_sample_with_fixed_k(ja_target, ja_draft_bpe):
    """With SpecConfig(adaptive=False) (fixed K, no fallback) the drafted cycles do not depend on timings or on
    earlier generations, so the same seed gives the same sample, here with another prompt in between."""
    from xtokspec import SpecConfig, XTokSpec

    spec = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(adaptive=False))
    prompt, other = "ファイルシステムをマウントするには", "設定ファイルの書式は"
    first = spec.generate(prompt, max_new_tokens=24, do_sample=True, temperature=1.0, seed=11)
    spec.generate(other, max_new_tokens=24, do_sample=True, temperature=1.0, seed=5)
    again = spec.generate(prompt, max_new_tokens=24, do_sample=True, temperature=1.0, seed=11)
    assert again.token_ids == first.token_ids and first.stats.alone_cycles == 0
    fresh = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(adaptive=False))
    assert fresh.generate(prompt, max_new_tokens=24, do_sample=True, temperature=1.0, seed=11).token_ids == first.token_ids


def test_api_and_cli_load_without_progress_bars(capfd):
    """Both load quietly: no transformers "Loading weights" bars unless XTokSpec(..., progress=True)."""
    from transformers.utils import logging as hf_logging

    from xtokspec import XTokSpec

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # transformers' default, whatever ran before in this process
    try:
        XTokSpec("ja-target", "ja-draft-bpe")
        assert "Loading weights" not in capfd.readouterr().err
        XTokSpec("ja-target", "ja-draft-bpe", progress=True)
        assert capfd.readouterr().err.count("Loading weights") >= 2  # the control: one bar per model
        XTokSpec("ja-target", "ja-draft-bpe")  # the hook is gone again
        assert "Loading weights" not in capfd.readouterr().err
    finally:
        if not enabled:
            hf_logging.disable_progress_bar()


def test_fetch_script_help_names_itself(capsys):
    from model_helpers import load_script

    with pytest.raises(SystemExit):
        load_script("benchmarks/real_models.py").main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python benchmarks/real_models.py")


@pytest.mark.slow
def test_cli_and_api_give_the_same_text(capsys):
    """Both load the checkpoint's own dtype (transformers' default), so the same prompt gives the same text."""
    from xtokspec import XTokSpec

    prompt = "ファイルシステムをマウントするには"
    assert main(["generate", prompt, "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    api = XTokSpec("ja-target", "ja-draft-bpe")
    assert out == api.generate(prompt, max_new_tokens=24).text + "\n"
    assert "bfloat16" in err and "stopped:" in err
    assert "Loading weights" not in err + capsys.readouterr().err  # neither shows loading bars


@pytest.mark.slow
def test_compare_runs_the_target_alone_and_prints_the_speedup(capsys):
    from xtokspec.cli.main import main

    assert main(["generate", "表計算ドキュメントのセル範囲は、", "--max-new-tokens", "16", "--compare", "--compare-runs", "2"]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "xtokspec / the target alone:" in line)
    assert "median of 2 pairs" in line and "neither side pays" in line
    assert "the same output" in err  # greedy: the target's own text


@pytest.mark.slow
def test_chat_flag_refuses_a_target_without_a_chat_template(capsys):
    assert main(["generate", "東京", "--chat", "--max-new-tokens", "4"]) == 2
    assert "no chat template" in capsys.readouterr().err
