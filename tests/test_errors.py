"""Bad input: a clear XTokSpecError naming the problem, never a stack trace from deep inside."""

from __future__ import annotations

import pytest
from model_helpers import tiny_llama

from xtokspec import XTokSpec, XTokSpecError


@pytest.mark.parametrize(
    "prompt,kwargs,match",
    [
        ("", {}, "prompt is empty"),
        (None, {}, "prompt must be a str, got NoneType"),
        (["東京"], {}, "prompt must be a str, got list"),
        ("東京", {"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ("東京", {"max_new_tokens": -3}, "max_new_tokens must be a positive integer"),
        ("東京", {"max_new_tokens": 2.5}, "max_new_tokens must be a positive integer"),
        ("東京", {"do_sample": True, "temperature": 0}, "temperature must be > 0"),
        ("東京", {"do_sample": True, "top_p": 0}, r"top_p must be in \(0, 1\]"),
        ("東京", {"do_sample": True, "top_k": -2}, "top_k must be an integer >= 0"),
        ("東京", {"do_sample": True, "proposal": "magic"}, "proposal must be"),
        ("東京", {"num_draft_tokens": 0}, "need 1 <= num_draft_tokens"),  # not the default in disguise
        ("東京", {"num_draft_tokens": 2.5}, "num_draft_tokens must be an integer, got 2.5"),
        ("東京", {"num_draft_tokens": True}, "num_draft_tokens must be an integer, got True"),
        ("東京", {"tree_width": 0}, "tree_width must be an integer >= 1"),
        # a SpecConfig field that generate() does not take per call: where it goes, not a TypeError
        ("東京", {"fallback": False}, r"'fallback' is set once per XTokSpec: XTokSpec\(\.\.\., config=SpecConfig"),
        ("東京", {"temprature": 0.7}, "'temprature' is not an option \\(did you mean 'temperature'\\?\\)"),
        ("東京", {"max_length": 8}, "'max_length' is not an option. They take: max_new_tokens, messages, do_sample, "),
        # generate's own parameters come first: max_new_tokens, not SpecConfig's max_draft_tokens
        ("東京", {"max_tokens": 8}, "'max_tokens' is not an option \\(did you mean 'max_new_tokens'\\?\\)"),
    ],
)
def test_bad_arguments_are_named(tiny_spec, prompt, kwargs, match):
    with pytest.raises(XTokSpecError, match=match):
        tiny_spec.generate(prompt, **kwargs)


def test_prompt_longer_than_the_target_context(tiny_spec):
    with pytest.raises(XTokSpecError, match=r"prompt is \d+ target tokens, but the target's context is 256"):
        tiny_spec.generate("東京" * 400, max_new_tokens=4)


def test_prompt_longer_than_the_tokenizers_maximum_gives_only_xtokspecs_error(tiny_spec, monkeypatch, caplog):
    """transformers warns when a tokenizer's ids outnumber its model_max_length (512 here); xtokspec encodes
    prompts without that warning and names the problem itself. The user's own tokenizer calls still warn."""
    key = "sequence-length-is-longer-than-the-specified-maximum"
    for tokenizer in (tiny_spec.target_tokenizer, tiny_spec.draft_tokenizer):
        monkeypatch.delitem(tokenizer.deprecation_warnings, key, raising=False)  # as if never warned
    prompt = "東京" * 1000  # ~4,000 target tokens
    caplog.clear()
    with pytest.raises(XTokSpecError, match=r"prompt is \d+ target tokens, but the target's context is 256"):
        tiny_spec.generate(prompt, max_new_tokens=4)
    assert not [r for r in caplog.records if "Token indices sequence length" in r.getMessage()]
    tiny_spec.target_tokenizer(prompt)  # the control: the same text through the tokenizer itself
    assert [r for r in caplog.records if "Token indices sequence length is longer" in r.getMessage()]


def test_generation_close_to_the_context_limit_stops_cleanly(tiny_spec):
    prompt = "東京"
    while len(tiny_spec.target.encode_prompt(prompt + "東京")) < 250:
        prompt += "東京"
    n_prompt = len(tiny_spec.target.encode_prompt(prompt))
    result = tiny_spec.generate(prompt, max_new_tokens=500)
    assert n_prompt + len(result.token_ids) <= 256


def test_unsupported_generation_config_is_named(sp_tokenizer, bpe_tokenizer):
    target = tiny_llama(sp_tokenizer, seed=5)
    target.generation_config.repetition_penalty = 1.2
    spec = XTokSpec((target, sp_tokenizer), (tiny_llama(sp_tokenizer, layers=1, seed=6), sp_tokenizer))
    with pytest.raises(XTokSpecError, match="repetition_penalty"):
        spec.generate("東京", max_new_tokens=2)


def test_wrong_model_argument_is_named():
    with pytest.raises(XTokSpecError, match=r"target \(large\): expected a path, a hub id or a \(model, tokenizer\) pair"):
        XTokSpec(42, "x")
    with pytest.raises(XTokSpecError, match="no such model folder: '/nonexistent/model'"):
        XTokSpec("/nonexistent/model", "/nonexistent/draft")


def test_draft_without_eos_and_text_it_cannot_encode(sp_tokenizer, tiny_target):
    """A draft tokenizer with no EOS and no byte fallback: output still equals the target's own."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("▁", -2.0)] + [(c, -3.0) for c in "東京都のはにをでがあいう"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    draft_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    draft_model = tiny_llama(draft_tok, layers=1, seed=7)
    draft_model.generation_config.eos_token_id = None
    # The probes of TokenCodec need characters this vocabulary lacks: the error names the draft tokenizer.
    with pytest.raises(XTokSpecError, match="draft tokenizer: cannot map its tokens to text"):
        XTokSpec(tiny_target, (draft_model, draft_tok))
    target, tokenizer = tiny_target
    with torch.inference_mode():
        ids = target.generate(**tokenizer("𠮷", return_tensors="pt"), do_sample=False, max_new_tokens=12)
    assert ids.shape[1] > 2


def test_result_text_skips_the_tokenizers_clean_up(tiny_spec, monkeypatch):
    """A tokenizer configured with clean_up_tokenization_spaces would delete the spaces before ' .' and ' ,';
    the continuation's text must be its tokens' own text."""
    tokenizer = tiny_spec.target_tokenizer
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    text = "値 . 設定 , 終わり"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) != text  # the control: clean-up does change it here
    assert tiny_spec._decode(ids) == text


# ---------------------------------------------------------------- a new user's first calls
def test_temperature_zero_means_greedy(tiny_spec):
    """temperature=0 without do_sample is the usual way to ask for greedy output: no error, greedy ids."""
    greedy = tiny_spec.generate("東京", max_new_tokens=6).token_ids
    assert tiny_spec.generate("東京", max_new_tokens=6, temperature=0).token_ids == greedy
    assert tiny_spec.generate("東京", max_new_tokens=6, temperature=0.0, do_sample=False).token_ids == greedy


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1}, r"temperature must be >= 0 \(0 means greedy"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"do_sample": True, "temperature": 0}, "temperature 0 means greedy decoding: use do_sample=False"),
    ],
)
def test_invalid_sampling_values_are_named_even_when_greedy(tiny_spec, kwargs, match):
    with pytest.raises(XTokSpecError, match=match):
        tiny_spec.generate("東京", max_new_tokens=2, **kwargs)


def test_sampling_values_without_do_sample_warn_and_stay_greedy(tiny_spec):
    greedy = tiny_spec.generate("東京", max_new_tokens=6).token_ids
    with pytest.warns(UserWarning, match=r"\{'temperature': 0.7\} only apply when sampling"):
        ids = tiny_spec.generate("東京", max_new_tokens=6, temperature=0.7).token_ids
    assert ids == greedy


def test_lone_surrogate_prompt_is_named(tiny_spec):
    with pytest.raises(XTokSpecError, match="lone surrogate"):
        tiny_spec.generate("東京\ud800", max_new_tokens=2)


def test_context_limit_has_its_own_stop_reason(tiny_spec):
    prompt = "東京"
    while len(tiny_spec.target.encode_prompt(prompt + "東京")) < 240:
        prompt += "東京"
    n_prompt = len(tiny_spec.target.encode_prompt(prompt))  # ~240 of the tiny target's 256 positions
    result = tiny_spec.generate(prompt, max_new_tokens=100)
    eos = result.token_ids[-1] in tiny_spec.target_eos
    assert result.stop_reason == ("eos" if eos else "context"), result.stop_reason
    if not eos:
        assert n_prompt + len(result.token_ids) == 256
    assert tiny_spec.generate("東京", max_new_tokens=3).stop_reason in ("eos", "length")


@pytest.mark.parametrize(
    "name,match",
    [
        ("./no/such/model", r"no such model folder: './no/such/model'"),
        ("path/to/large", r"no such model folder: 'path/to/large'"),
        ("tests/no-such-model", r"no such model folder"),  # first part is a folder here: local, not a hub id
        ("ja-targt", r"did you mean the bundled 'ja-target'"),
        ("models/ja-targt", r"no model folder 'models/ja-targt'; did you mean the bundled 'ja-target'"),
        ("fixtures/models/ja-targt", r"no such model folder: 'fixtures/models/ja-targt' \(did you mean "
         r"'fixtures/models/ja-target'\?\)"),
        ("tests", r"'tests' has no config.json: not a transformers model folder"),
    ],
)
def test_local_looking_paths_fail_fast_without_a_hub_lookup(name, match, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("a hub lookup was attempted")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    with pytest.raises(XTokSpecError, match=match):
        XTokSpec(name, "ja-draft-bpe")


@pytest.mark.parametrize("draft", ["models/ja-draft-bep", "./no/such/draft", "fixtures/models/ja-draft"])
def test_a_mistyped_draft_is_named_before_the_target_loads(draft, monkeypatch):
    """Both model arguments are checked before either model loads: no tokenizer or model of the target is read,
    and no hub lookup is made, before the draft's error."""
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded (or looked up on the hub) before the draft was checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_load)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(XTokSpecError, match=r"^draft \(small\): no "):
        XTokSpec("ja-target", draft)


def test_bundled_names_resolve_to_the_fixtures():
    from xtokspec.runtime.models import fixtures_dir, resolve

    for name in ("ja-target", "ja-draft-same", "ja-draft-bpe"):
        assert resolve(name, "target") == fixtures_dir() / "models" / name
    assert resolve("gpt2", "target") == "gpt2"  # a hub id stays a hub id
