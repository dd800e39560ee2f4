"""`xtokspec distill` end to end on tiny models: a random-weight target on ja-sp (SentencePiece with byte fallback)
and a random-weight draft on ja-bpe (byte-level BPE, another tokenizer), whose acceptance starts at zero; and
every error it names."""

from __future__ import annotations

import json
import random

import pytest
import torch
from model_helpers import tiny_llama, tiny_neox

from xtokspec import XTokSpec, XTokSpecError
from xtokspec.cli.main import main
from xtokspec.distill import evaluate as distill_eval
from xtokspec.distill import pipeline as distill_module
from xtokspec.distill.pipeline import (
    REPORT_FILE,
    DistillSettings,
    distill,
    first_difference,
    read_prompts,
    split_prompts,
    training_examples,
)

WORDS = ["ファイル", "設定", "表示", "する", "の", "を", "は", "コマンド", "オプション", "です", "、", "。", "ユーザー", "画面"]


def toy_prompts(n: int, seed: int = 0) -> list[str]:
    """A toy distribution: `n` distinct runs of 2-5 common words."""
    rng, prompts = random.Random(seed), {}
    while len(prompts) < n:
        prompts["".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))] = None
    return list(prompts)


PROMPTS = toy_prompts(200)
QUICK = dict(new_tokens=12, max_steps=4, batch_size=8, eval_count=2, eval_new_tokens=8, modes=("greedy",),
             progress=False)


@pytest.fixture
def pair(sp_tokenizer, bpe_tokenizer):
    """A fresh random target and draft for each test (training changes neither: distill trains a copy)."""
    return (tiny_llama(sp_tokenizer, seed=0), sp_tokenizer), (tiny_neox(bpe_tokenizer), bpe_tokenizer)


def test_distilled_draft_is_accepted_more_and_output_stays_the_targets(pair, tmp_path):
    target, draft = pair
    out = tmp_path / "draft"
    report = distill(target, draft, PROMPTS, out, new_tokens=24, modes=("greedy",), max_steps=150, batch_size=16,
                     learning_rate=1e-2, eval_count=8, eval_new_tokens=24, gen_batch=32, seed=0, progress=False)
    before, after = report["evaluation"]["before"], report["evaluation"]["after"]
    # measured: 0.00 -> 0.30 on the 8 held-out prompts (seed 0, 150 steps; the same with and without bf16 autocast)
    assert before["token_acceptance"] < 0.05
    assert after["token_acceptance"] >= before["token_acceptance"] + 0.2, report["evaluation"]
    assert after["greedy_same_as_target"] == "8/8"
    # The teacher-forced agreement on the same 8 prompts moves with it, its 95% interval above zero.
    # measured: 0.00 -> 0.49, gain interval 0.41 to 0.57
    agreement = report["evaluation"]["agreement"]
    assert agreement["prompts"] == 8 and agreement["before"] < 0.05, agreement
    assert agreement["gain"] >= 0.2 and agreement["gain_ci95"][0] > 0, agreement
    assert report["data"]["train_prompts"] == 192 and report["data"]["continuations"] == 192
    assert report["training"]["steps"] == 150
    assert report["training"]["last_logged_loss"] < report["training"]["first_logged_loss"] - 1
    # The folder loads like any draft, its tokenizer with it; the report is beside the weights; nothing else is left.
    assert json.loads((out / REPORT_FILE).read_text(encoding="utf-8")) == json.loads(json.dumps(report))
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    spec = XTokSpec(target, str(out))
    assert spec.draft_tokenizer.get_vocab() == draft[1].get_vocab()
    _, held = split_prompts(PROMPTS, None, DistillSettings(eval_count=8, seed=0))
    model, tokenizer = target
    for prompt in held[:4]:
        result = spec.generate(prompt, max_new_tokens=16)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = model.generate(ids, attention_mask=ids.new_ones(ids.shape), do_sample=False, max_new_tokens=16,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert result.token_ids == alone[0, ids.shape[1]:].tolist()


def test_the_prompt_is_out_of_the_loss(bpe_tokenizer):
    records = [{"prompt": "設定ファイル", "continuation": "を表示する", "eos": True},
               {"prompt": "画面", "continuation": "", "eos": False}]  # nothing to learn: dropped
    (example,) = training_examples(bpe_tokenizer, records, 64)
    ids, labels = example["input_ids"], example["labels"]
    prompt_len = len(bpe_tokenizer("設定ファイル").input_ids)
    assert ids[-1] == bpe_tokenizer.eos_token_id and labels[-1] == bpe_tokenizer.eos_token_id
    assert labels[:prompt_len] == [-100] * prompt_len
    learned = [i for i, label in zip(ids, labels, strict=True) if label != -100]
    assert bpe_tokenizer.decode(learned[:-1]) == "を表示する"


def test_continuations_cut_inside_a_character_lose_the_partial_character(sp_tokenizer):
    class Scripted(torch.nn.Module):
        """A 'model' whose generate appends fixed ids: 東 (3 byte tokens) then the first byte of 京."""

        config = type("C", (), {"vocab_size": len(sp_tokenizer)})()
        generation_config = type("G", (), {"eos_token_id": sp_tokenizer.eos_token_id})()

        def get_input_embeddings(self):
            return torch.nn.Embedding(1, 1)

        def generate(self, input_ids, **kwargs):
            new = [sp_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "東京".encode()[:4]]
            return torch.cat([input_ids, torch.tensor([new] * len(input_ids))], dim=1)

    (record,) = distill_module.continue_prompts(Scripted(), sp_tokenizer, ["設定"], "greedy", 4, 0)
    assert record["continuation"] == "東" and record["cut"] and not record["eos"]


def test_prompt_sources_and_their_errors(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("一つ目\n\n二つ目\n", encoding="utf-8")
    assert read_prompts(text) == ["一つ目", "二つ目"]
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "一"}\n{"text": "二", "x": 1}\n', encoding="utf-8")
    assert read_prompts(str(lines)) == ["一", "二"]
    lines.write_text('{"body": "一"}\n', encoding="utf-8")
    with pytest.raises(XTokSpecError, match=r'p.jsonl:1: a JSON line needs a "prompt" or "text"'):
        read_prompts(lines)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(XTokSpecError, match="empty.txt' has no prompts"):
        read_prompts(empty)
    with pytest.raises(XTokSpecError, match="has no prompts"):
        read_prompts([])
    with pytest.raises(XTokSpecError, match="cannot read the prompts file"):
        read_prompts(tmp_path / "missing.txt")


def test_errors_come_before_any_model_loads(tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("xtokspec.spec.XTokSpec.__init__", no_loading)
    with pytest.raises(XTokSpecError, match="has no prompts"):
        distill("ja-target", "ja-draft-bpe", [], tmp_path / "a")
    with pytest.raises(XTokSpecError, match="3 distinct prompts cannot keep 16 held out"):
        distill("ja-target", "ja-draft-bpe", ["一", "二", "三"], tmp_path / "a")
    with pytest.raises(XTokSpecError, match="no such model folder"):
        distill("ja-target", str(tmp_path / "nowhere"), PROMPTS, tmp_path / "a")
    existing = tmp_path / "taken"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(XTokSpecError, match="'.*taken' exists: choose another output folder, or pass overwrite=True"):
        distill("ja-target", "ja-draft-bpe", PROMPTS, existing)
    assert (existing / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "a.partial").exists() and not (tmp_path / "a").exists()


def test_a_pair_that_cannot_be_bridged_is_refused(sp_tokenizer, tiny_target, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wordy = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(XTokSpecError, match="draft tokenizer: cannot map its tokens to text"):
        distill(tiny_target, (tiny_llama(wordy, layers=1), wordy), PROMPTS, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing written: no output, no work folder to resume


def test_engine_vllm_without_vllm_is_named(pair, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails as if it were not installed
    monkeypatch.setattr(distill_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(XTokSpecError, match=r"engine='vllm' \(--engine vllm\) needs vLLM: pip install vllm"):
        distill(*pair, PROMPTS, tmp_path / "out", engine="vllm", **QUICK)
    with pytest.raises(XTokSpecError, match="engine must be one of"):
        distill(*pair, PROMPTS, tmp_path / "out", engine="sglang", **QUICK)
    assert list(tmp_path.iterdir()) == []  # named before anything is generated or written


def test_lora_without_peft_is_named(pair, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails as if it were not installed
    with pytest.raises(XTokSpecError, match=r"lora=True \(--lora\) needs peft, which is not installed"):
        distill(*pair, PROMPTS, tmp_path / "out", lora=True, **QUICK)
    assert list(tmp_path.iterdir()) == []  # named before anything is generated or written


def test_lora_trains_adapters_and_saves_a_plain_model(pair, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "out"
    report = distill(*pair, PROMPTS, out, lora=True, lora_rank=4, **QUICK)
    assert report["training"]["lora"] and report["training"]["steps"] == 4
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt_neox" and not (out / "adapter_config.json").exists()
    XTokSpec(pair[0], str(out)).generate(PROMPTS[0], max_new_tokens=4)


def test_frozen_embeddings_stay_as_they_were_and_the_rest_trains(pair, tmp_path):
    """freeze_embeddings: the saved draft's input embeddings are the original ones, bit for bit; its other weights
    (the untied output head, the layers) moved, and the report counts only those as trained."""
    from transformers import AutoModelForCausalLM

    draft_model = pair[1][0]
    before = {name: tensor.detach().clone() for name, tensor in draft_model.state_dict().items()}
    out = tmp_path / "out"
    report = distill(*pair, PROMPTS, out, freeze_embeddings=True, learning_rate=1e-2, **QUICK)
    after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    embeddings = "gpt_neox.embed_in.weight"
    assert after.keys() == before.keys()
    assert torch.equal(after[embeddings], before[embeddings])
    moved = [name for name in after if not torch.equal(after[name], before[name])]
    assert "lm_head.weight" in moved and len(moved) > 10
    total = sum(p.numel() for p in draft_model.parameters())
    assert report["training"]["trained_parameters"] == total - before[embeddings].numel()


def test_an_interrupted_run_resumes_without_generating_again(pair, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_train = distill_module.train_draft

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_module, "train_draft", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(*pair, PROMPTS, out, **QUICK)
    partial = tmp_path / "out.partial"
    assert not out.exists() and (partial / "distill_data.jsonl").exists()
    data = (partial / "distill_data.jsonl").read_text(encoding="utf-8")
    assert len(data.splitlines()) == 198  # 200 prompts, 2 held out, greedy only
    with pytest.raises(XTokSpecError, match="an interrupted run left .*out.partial': pass resume=True"):
        distill(*pair, PROMPTS, out, **QUICK)
    with pytest.raises(XTokSpecError, match="--resume: .* was started with other settings"):
        distill(*pair, PROMPTS, out, resume=True, **{**QUICK, "new_tokens": 13})
    monkeypatch.setattr(distill_module, "train_draft", real_train)
    continued, real_continue = [], distill_module.continue_prompts

    def recorded(model, tokenizer, prompts, *args, **kwargs):
        continued.extend(prompts)
        return real_continue(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(distill_module, "continue_prompts", recorded)
    monkeypatch.setattr(distill_eval, "continue_prompts", recorded)
    report = distill(*pair, PROMPTS, out, resume=True, **QUICK)
    assert report["data"]["continuations"] == 198 and not partial.exists()
    _, held = split_prompts(PROMPTS, None, DistillSettings(eval_count=2))
    assert continued == held  # the data is there: only the evaluation's held-out prompts are continued
    assert (out / "distill_data.jsonl").read_text(encoding="utf-8") == data


def test_overwrite_replaces_the_folder_and_starts_over(pair, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    stale = tmp_path / "out.partial"
    stale.mkdir()
    (stale / "distill_data.jsonl").write_text('{"broken": \n')
    report = distill(*pair, PROMPTS, out, overwrite=True, **QUICK)
    assert report["training"]["steps"] == 4 and not (out / "old.txt").exists() and (out / REPORT_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli_distills_model_folders(pair, tmp_path, capsys):
    (target, t_tok), (draft, d_tok) = pair
    for name, model, tok in (("t", target, t_tok), ("d", draft, d_tok)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:40]) + "\n", encoding="utf-8")
    args = ["distill", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--prompts", str(prompts),
            "--out", str(tmp_path / "out"), "--new-tokens", "8", "--max-steps", "3", "--batch-size", "4",
            "--eval-count", "2", "--agreement-count", "4", "--eval-new-tokens", "6", "--modes", "greedy", "sampled",
            "--lr", "3e-5", "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "72 continuations, 3 steps" in err and "greedy per-token acceptance on 2 held-out prompts" in err
    assert "teacher-forced agreement with the target's greedy text on 4 held-out prompts" in err
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text(encoding="utf-8"))
    assert report["data"]["per_mode"] == {"greedy": 36, "sampled": 36}
    assert report["settings"]["learning_rate"] == 3e-5 and report["settings"]["max_steps"] == 3  # options reach it
    assert report["evaluation"]["prompts"] == 2 and report["evaluation"]["agreement"]["prompts"] == 4
    assert main(args) == 2
    assert "exists: choose another output folder, or pass overwrite=True (--overwrite)" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args[args.index(str(prompts))], args[args.index(str(tmp_path / "out"))] = str(empty), str(tmp_path / "other")
    assert main(args) == 2
    assert "has no prompts" in capsys.readouterr().err


def test_token_level_targets_sit_where_both_tokenizations_start_a_token(bpe_tokenizer):
    import math

    from xtokspec.text.codec import TokenCodec

    codec = TokenCodec(bpe_tokenizer, name="draft")
    prompt, continuation = "ユーザーは", "ファイルを表示する"  # ja-bpe: ユーザーは | ファイル | を表示する
    ids = bpe_tokenizer(prompt + continuation).input_ids
    ends = [len(b"".join(codec.token_bytes[i] for i in ids[: n + 1])) - len(prompt.encode()) for n in range(len(ids))]
    first = next(n for n, end in enumerate(ends) if end > 0)  # the first token of the continuation
    assert ends[first - 1] == 0, "ja-bpe starts a token where the continuation starts"
    second = first + 1
    # The target's top ids at three offsets: where the draft's first and second continuation tokens start, and 1
    # byte in (inside a character, where no draft token starts). Target ids 100-103 stand for draft ids 7, 8, 9.
    target_to_draft = {100: 7, 101: 8, 103: 9}
    top = [[0, [100, 102], [math.log(0.6), math.log(0.2)]],  # 102: no draft token of its bytes, left out
           [ends[first], [101, 103], [math.log(0.5), math.log(0.3)]],
           [1, [100], [0.0]]]
    record = {"prompt": prompt, "continuation": continuation, "eos": False, "target_top": top}
    (example,) = training_examples(bpe_tokenizer, [record], 64, codec, target_to_draft)
    assert example["soft_pos"] == [first - 1, second - 1]  # the logits that predict those tokens
    assert example["soft_ids"] == [[7], [8, 9]]
    assert [p for row in example["soft_p"] for p in row] == pytest.approx([1.0, 0.5 / 0.8, 0.3 / 0.8])
    assert "soft_pos" not in training_examples(bpe_tokenizer, [record], 64)[0]  # without the map: sequence-level


def test_cut_records_end_where_the_bridge_leaves_the_draft_at_a_cycle_start(bpe_tokenizer, sp_tokenizer):
    """cut_share=1: every record with a target token boundary inside one of the draft's own tokens (of the
    continuation) is tokenized as the bridge shows it at a cycle start there: its ids spell the same bytes, a
    first part ends exactly at such a boundary, and the rest is the bridge's own encoding of the remaining text;
    the prompt stays out of the loss. Checked against a brute-force search for the cut; cut_share=0 changes
    nothing."""
    from xtokspec.text.codec import TokenCodec

    draft, target = TokenCodec(bpe_tokenizer, name="draft"), TokenCodec(sp_tokenizer, name="target")
    rng = random.Random(3)
    records = [{"prompt": p, "continuation": "".join(rng.choice(WORDS) for _ in range(6)), "eos": False}
               for p in toy_prompts(40, seed=5)]
    plain = training_examples(bpe_tokenizer, records, 256)
    assert training_examples(bpe_tokenizer, records, 256, draft, None, target, 0.0) == plain
    cut = training_examples(bpe_tokenizer, records, 256, draft, None, target, 1.0, seed=1)
    n_cut = 0
    for record, before, after in zip(records, plain, cut, strict=True):
        prompt = record["prompt"].encode()
        text = prompt + record["continuation"].encode()
        canonical = [0]
        for i in before["input_ids"]:
            canonical.append(canonical[-1] + len(draft.token_bytes[i]))
        _, t_ends = target.encode_stream(record["continuation"])
        possible = {len(prompt) + e for e in t_ends[:-1]} & {
            pos for a, b in zip(canonical, canonical[1:], strict=False) for pos in range(a + 1, b)}
        ids = after["input_ids"]
        assert b"".join(draft.token_bytes[i] for i in ids) == text
        if not possible:
            assert after == before
            continue
        n_cut += 1
        ends = [len(b"".join(draft.token_bytes[i] for i in ids[:m])) for m in range(len(ids) + 1)]
        splits = [m for m, end in enumerate(ends) if end in possible
                  and ids[m:] == draft.encode_stream(text[end:].decode())[0]]
        assert splits, (record, ids)
        starts = ends[:-1]
        assert after["labels"] == [i if start >= len(prompt) else -100 for i, start in zip(ids, starts, strict=True)]
    assert n_cut >= 10, n_cut


def test_cut_share_reaches_the_training_sequences(pair, tmp_path, monkeypatch):
    """distill(cut_share=1.0) trains on cut sequences (the target's codec handed to training_examples, some
    sequences no longer the draft's plain tokenization); a share outside [0, 1] is refused before anything runs."""
    calls = []
    original = distill_module.training_examples

    def spy(*args, **kwargs):
        calls.append((args, original(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(distill_module, "training_examples", spy)
    report = distill(*pair, PROMPTS, tmp_path / "out", **QUICK, cut_share=1.0)
    assert report["settings"]["cut_share"] == 1.0
    (args, cut), = calls
    tokenizer, records, max_length = args[:3]
    plain = original(tokenizer, records, max_length)
    # most toy continuations (12 tokens of a random target) have no target boundary inside a draft token: 37 of
    # 197 are cut
    assert len(cut) == len(plain) and sum(a != b for a, b in zip(cut, plain, strict=True)) >= 10
    with pytest.raises(XTokSpecError, match="cut_share must be between 0 and 1"):
        distill(*pair, PROMPTS, tmp_path / "other", **QUICK, cut_share=1.5)


def test_token_level_loss_trains_where_the_vocabularies_meet(pair, tmp_path):
    report = distill(*pair, PROMPTS, tmp_path / "out", **{**QUICK, "max_steps": 20, "learning_rate": 1e-2},
                     token_loss=1.0, token_top_k=8)
    training = report["training"]
    assert training["token_loss_weight"] == 1.0 and training["soft_positions"] > 100
    assert training["token_loss_last"] < training["token_loss_first"]
    data = (tmp_path / "out" / "distill_data.jsonl").read_text(encoding="utf-8").splitlines()
    assert all(len(entry[1]) == 8 for line in data for entry in json.loads(line)["target_top"])


def test_a_time_budget_too_short_for_any_data_is_named(pair, tmp_path):
    with pytest.raises(XTokSpecError, match="the time budget ended before the target continued any prompt"):
        distill(*pair, PROMPTS, tmp_path / "out", max_seconds=1e-6, **QUICK)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_distill_trains_when_called_with_gradients_off(pair, tmp_path, mode):
    """A caller in no_grad or inference mode (an inference script, a notebook after generating) still trains."""
    draft_before = [p.detach().clone() for p in pair[1][0].parameters()]
    with getattr(torch, mode)():
        report = distill(*pair, PROMPTS, tmp_path / "out", **QUICK)
    assert report["training"]["steps"] == QUICK["max_steps"]
    trained = XTokSpec(pair[0], str(tmp_path / "out")).draft_model
    assert any(not torch.equal(a, b.to(a.dtype)) for a, b in zip(draft_before, trained.parameters(), strict=True))


def test_first_difference_reports_where_and_by_what_margin_an_output_departs(pair):
    """The margin of a departure is the target's own logit gap there (a near-tie is told from a bug by it)."""
    (model, tokenizer), _ = pair
    prompt_ids = tokenizer("ファイルの設定", add_special_tokens=True)["input_ids"]
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=6, min_new_tokens=6)[0, len(prompt_ids):].tolist()
        logits = model(input_ids=torch.tensor([prompt_ids + reference[:3]])).logits[0, -1].float()
    other = int(logits.argsort(descending=True)[1])  # the target's second choice at token 3
    got = reference[:3] + [other] + reference[4:]
    found = first_difference(model, prompt_ids, reference, got)
    assert found["token"] == 3 and found["target"] == reference[3] and found["got"] == other
    assert found["margin"] == pytest.approx(float(logits[reference[3]] - logits[other]), abs=1e-4)
    assert found["logit"] == pytest.approx(float(logits[reference[3]]), abs=1e-4)
    assert found["margin"] >= 0  # greedy: the target's own choice is its argmax
    assert first_difference(model, prompt_ids, reference, reference[:4]) is None  # a prefix agrees


class _ReadsAhead(torch.nn.Module):
    """A 'draft' whose argmax at each position is the next input id: it agrees with any text, token for token,
    when its logits line up with the positions they predict; an off-by-one in that alignment scores about zero."""

    def __init__(self, vocab: int, keeps: bool = True):
        super().__init__()
        self.vocab, self.keeps = vocab, keeps

    def get_input_embeddings(self):
        return torch.nn.Embedding(1, 1)

    def forward(self, input_ids, **kwargs):
        if not self.keeps and "logits_to_keep" in kwargs:
            raise TypeError("forward() got an unexpected keyword argument 'logits_to_keep'")
        ahead = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # (1, T)
        logits = torch.nn.functional.one_hot(ahead, self.vocab).float()  # (1, T, V)
        keep = kwargs.get("logits_to_keep", 0)
        return type("Out", (), {"logits": logits[:, -keep:] if keep else logits})()


@pytest.mark.parametrize("keeps", [True, False], ids=["logits_to_keep", "full-logits"])
def test_agreement_counts_the_continuations_characters_the_draft_writes(bpe_tokenizer, keeps):
    records = [{"prompt": "設定ファイル", "continuation": "を表示するユーザー", "eos": True},
               {"prompt": "画面", "continuation": "", "eos": False},  # nothing to score
               {"prompt": "コマンドは", "continuation": "オプションです。", "eos": False}]
    counts = distill_module.agreement_counts(_ReadsAhead(len(bpe_tokenizer), keeps), bpe_tokenizer, records)
    assert counts == [(9, 9), (0, 0), (8, 8)]  # every character of the two continuations, written
    # Wrong on one token: the characters it covers, and only those, are not written.
    enc = bpe_tokenizer("設定ファイルを表示するユーザー", return_offsets_mapping=True)
    last, (a, b) = enc["input_ids"][-1], enc["offset_mapping"][-1]

    class MissesLast(_ReadsAhead):
        def forward(self, input_ids, **kwargs):
            out = super().forward(input_ids, **kwargs)
            out.logits[..., last] -= 2  # where `last` comes next, another id (all zeros) ties ahead at argmax
            return out

    missed = distill_module.agreement_counts(MissesLast(len(bpe_tokenizer), keeps), bpe_tokenizer, records[:1])
    assert 0 < b - a < 9 and missed == [(9 - (b - a), 9)]
    # Per token of a tokenizer (the target's, in distill): here the draft's own, so one token of them is missed.
    tokens = sum(a >= len("設定ファイル") for a, _ in enc["offset_mapping"])
    per_token = distill_module.agreement_counts(MissesLast(len(bpe_tokenizer), keeps), bpe_tokenizer, records[:1],
                                                units=bpe_tokenizer)
    assert tokens >= 2 and per_token == [(tokens - 1, tokens)]

    class Copies(_ReadsAhead):  # the control: its argmax is the current id, almost never the next one
        def forward(self, input_ids, **kwargs):
            return super().forward(torch.cat([input_ids[:, -1:], input_ids[:, :-1]], dim=1), **kwargs)

    wrong = distill_module.agreement_counts(Copies(len(bpe_tokenizer), keeps), bpe_tokenizer, records)
    assert sum(h for h, _ in wrong) <= 1 and [n for _, n in wrong] == [n for _, n in counts]


def test_paired_interval_resamples_prompts():
    same = [(3, 10), (0, 4), (7, 7)]
    assert distill_module.paired_interval(same, same) == [0.0, 0.0]  # no gain on any resample
    # Every prompt gains the same share: every resample gains exactly that.
    lo, hi = distill_module.paired_interval([(2, 10), (1, 5)], [(4, 10), (2, 5)])
    assert lo == pytest.approx(0.2) and hi == pytest.approx(0.2)
    # Prompts that disagree: the interval spans the point gain, wider with fewer prompts.
    before, after = [(5, 10)] * 20, [(9, 10)] * 10 + [(4, 10)] * 10
    lo, hi = distill_module.paired_interval(before, after)
    assert lo < 0.15 < hi and hi - lo > 0.1
    lo4, hi4 = distill_module.paired_interval(before * 4, after * 4)
    assert lo4 < 0.15 < hi4 and hi4 - lo4 < (hi - lo) * 0.7
