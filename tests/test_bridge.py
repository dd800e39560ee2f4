"""The text bridge on tiny hand-built vocabularies and, with hypothesis, on the fixture tokenizers."""

from __future__ import annotations

import unicodedata

import pytest
import vocabs
from hypothesis import given, settings
from hypothesis import strategies as st

from xtokspec.text.bridge import PrefixIndex, TextSync, build_token_map, common_prefix_len, propose_target_ids
from xtokspec.text.codec import TokenCodec, utf8_valid_prefix_len
from xtokspec.types import XTokSpecError


@pytest.fixture(scope="module")
def sp():
    return TokenCodec(vocabs.sp_tokenizer(), name="tiny-sp")


@pytest.fixture(scope="module")
def bpe():
    return TokenCodec(vocabs.bpe_tokenizer(), name="tiny-bpe")


def pieces(codec: TokenCodec, ids: list[int]) -> list[str]:
    return codec.tokenizer.convert_ids_to_tokens(ids)


def sp_id(codec: TokenCodec, piece: str) -> int:
    return codec.tokenizer.convert_tokens_to_ids(piece)


def test_token_bytes_follow_each_tokenizer_kind(sp, bpe):
    assert sp.kind == "sentencepiece" and bpe.kind == "byte_level"
    assert sp.token_bytes[sp_id(sp, "▁ab")] == b" ab"
    assert sp.token_bytes[sp_id(sp, "<0xE3>")] == b"\xe3"
    assert sp.token_bytes[sp_id(sp, "東京")] == "東京".encode()
    assert sp.token_bytes[sp.tokenizer.bos_token_id] == b""  # specials stand for no text
    (a_id,) = bpe.encode_fragment(" a")
    assert pieces(bpe, [a_id]) == ["Ġa"] and bpe.token_bytes[a_id] == b" a"
    assert bpe.byte_ids[0xE6] == bpe.tokenizer.convert_tokens_to_ids("æ")


def test_fragments_have_no_bos_and_no_dummy_prefix(sp):
    assert pieces(sp, sp.encode_prompt("東京")) == ["<s>", "▁", "東京"]
    assert pieces(sp, sp.encode_fragment("東京")) == ["東京"]
    assert pieces(sp, sp.encode_fragment(" ab")) == ["▁ab"]
    assert sp.bytes_of(sp.encode_fragment("東京 ab")) == "東京 ab".encode()


def test_boundary_is_kept_when_appended_text_would_merge(sp, bpe):
    """Committed "東" + drafted "京": the target can not re-segment into "東京"; propose "京" after it."""
    sync = TextSync(sp, bpe)
    keep, extra = sync.commit([sp_id(sp, "東")], drafted=[])
    assert (keep, bpe.bytes_of(extra)) == (0, "東".encode())
    proposals = sync.propose(bpe.encode_fragment("京都"))
    assert pieces(sp, proposals) == ["京", "都"]


def test_one_draft_token_spans_two_target_tokens(sp, bpe):
    (kyoto,) = bpe.encode_fragment("京都")  # one BPE token, two SentencePiece pieces
    proposals = propose_target_ids(sp, b"", bpe.token_bytes[kyoto])
    assert pieces(sp, proposals) == ["京", "都"]


def test_incomplete_character_is_held_back(sp, bpe):
    """A draft ending inside a UTF-8 character proposes only the complete characters before it."""
    drafted = bpe.encode_fragment("東") + [bpe.byte_ids[0xE4], bpe.byte_ids[0xBA]]  # 京 = E4 BA AC, cut short
    proposals = TextSync(sp, bpe).propose(drafted)
    assert pieces(sp, proposals) == ["東"]
    assert "\ufffd" not in sp.tokenizer.decode(proposals)


def test_pending_partial_character_completed_with_byte_pieces(sp, bpe):
    """The target committed the first two bytes of 𠮷 (F0 A0 AE B7); the draft restates the character."""
    sync = TextSync(sp, bpe)
    keep, extra = sync.commit([sp_id(sp, "<0xF0>"), sp_id(sp, "<0xA0>")], drafted=[])
    assert (keep, extra, sync.pending) == (0, [], b"\xf0\xa0")  # the draft is not shown half a character
    proposals = sync.propose(bpe.encode_fragment("𠮷野"))
    assert pieces(sp, proposals) == ["<0xAE>", "<0xB7>", "野"]
    keep, extra = sync.commit(proposals, drafted=bpe.encode_fragment("𠮷野"))
    assert bpe.bytes_of(extra) == b"" and keep == len(bpe.encode_fragment("𠮷野"))
    assert sync.committed.decode() == "𠮷野"


def test_pending_mismatch_proposes_nothing(sp, bpe):
    sync = TextSync(sp, bpe)
    sync.commit([sp_id(sp, "<0xF0>")], drafted=[])
    assert sync.propose(bpe.encode_fragment("東京")) == []


def test_commit_keeps_agreeing_draft_tokens_and_reencodes_the_rest(sp, bpe):
    sync = TextSync(sp, bpe)
    drafted = bpe.encode_fragment("東京 ab")  # 東京 | Ġa | b
    keep, extra = sync.commit([sp_id(sp, "東京"), sp_id(sp, "▁ab"), sp_id(sp, "野")], drafted)
    assert keep == 3 and bpe.bytes_of(extra) == "野".encode()  # all drafted kept, the correction re-encoded
    keep, extra = sync.commit([sp_id(sp, "家")], drafted=bpe.encode_fragment("東"))
    assert keep == 4 and bpe.bytes_of(extra) == "家".encode()  # the disagreeing draft token is dropped


def test_drafted_eos_becomes_a_candidate_and_is_never_kept(sp, bpe):
    sync = TextSync(sp, bpe)
    eos_d, eos_t = bpe.tokenizer.eos_token_id, sp.tokenizer.eos_token_id
    drafted = bpe.encode_fragment("東京")
    assert pieces(sp, sync.propose(drafted, eos_candidate=eos_t)) == ["東京", "</s>"]
    keep, extra = sync.commit([sp_id(sp, "東京"), sp_id(sp, "都")], drafted + [eos_d])
    assert keep == len(drafted) and bpe.bytes_of(extra) == "都".encode()
    incomplete = drafted + [bpe.byte_ids[0xE4]]  # text not fully proposable: no EOS candidate after it
    assert eos_t not in TextSync(sp, bpe).propose(incomplete, eos_candidate=eos_t)


def test_a_branch_can_be_made_to_start_with_its_drawn_first_piece(sp, bpe):
    """A sampled tree root draws the target token a branch starts with (the first piece of its first draft
    token); the rest of the branch's bytes follow it, a character it ends inside completed by byte pieces."""
    sync = TextSync(sp, bpe)
    drafted = bpe.encode_fragment("東京都")  # 東京 | 都
    assert pieces(sp, sync.propose(drafted)) == ["東京", "都"]
    assert pieces(sp, sync.propose_from(sp_id(sp, "東"), drafted)) == ["東", "京", "都"]
    e6 = sp_id(sp, "<0xE6>")  # the first of 東's three bytes (E6 9D B1)
    assert pieces(sp, sync.propose_from(e6, drafted)) == ["<0xE6>", "<0x9D>", "<0xB1>", "京", "都"]
    eos_t = sp.tokenizer.eos_token_id
    assert pieces(sp, sync.propose_from(sp_id(sp, "東"), drafted, eos_candidate=eos_t))[-1] == "</s>"
    with pytest.raises(ValueError, match="first piece"):
        sync.propose_from(sp_id(sp, "京"), drafted)
    sync.commit([sp_id(sp, "<0xF0>")], drafted=[])  # an incomplete character is pending: no first pieces
    with pytest.raises(ValueError, match="first piece"):
        sync.propose_from(sp_id(sp, "東"), drafted)


def test_prefix_index_finds_the_tokens_that_may_restate_text(bpe):
    index = PrefixIndex(bpe.token_bytes)
    tokyo, to = bpe.encode_fragment("東京")[0], bpe.encode_fragment("東")[0]
    to_bytes = "東".encode()
    brute = {i for i, tb in enumerate(bpe.token_bytes) if tb.startswith(to_bytes)}  # 東, 東京 and BPE's merges between
    assert set(index.starting_with(to_bytes)) == brute and {to, tokyo} <= brute
    assert index.extends(to_bytes) and not index.extends("東京".encode())
    ids, covering = index.allowed(to_bytes)
    assert set(ids) == brute and covering
    # no token starts with "東京都": its proper prefixes may restate it one token at a time
    ids, covering = index.allowed("東京都".encode())
    assert not covering and tokyo in ids and to in ids and bpe.byte_ids[0xE6] in ids
    assert all("東京都".encode().startswith(bpe.token_bytes[i]) for i in ids)
    assert len(index.starting_with(b"")) == sum(1 for tb in bpe.token_bytes if tb)


def test_prefix_index_ranges_hold_at_the_top_byte():
    """A prefix ending in 0xFF bytes: its range ends where its stem's last byte + 1 starts (brute force)."""
    import random

    rng = random.Random(0)
    table = [b""] + [bytes(rng.choice(b"ab\xfe\xff") for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    index = PrefixIndex(table)
    for prefix in (b"", b"a", b"\xff", b"a\xff", b"\xff\xff", b"b\xfe", b"\xff" * 5):
        assert sorted(index.starting_with(prefix)) == [i for i, tb in enumerate(table) if tb and tb.startswith(prefix)]


def test_healing_restates_the_drafts_last_token(sp, bpe):
    """The target committed "東"; the draft's own token for it extends to "東京", so healing may take it back off
    the draft's view: the committed "東" is then pending, the draft restates it with its "東京" token, and the
    proposal is what follows it. Once the text goes on, the drafted "東京" is kept."""
    index = PrefixIndex(bpe.token_bytes)
    sync = TextSync(sp, bpe)
    keep, extra = sync.commit([sp_id(sp, "東")], drafted=[])
    assert (keep, bpe.bytes_of(extra), sync.pending) == (0, "東".encode(), b"")
    assert sync.healable("東".encode(), index) and not sync.healable("京".encode(), index)
    sync.heal()
    assert (sync.synced, sync.pending, sync.draft_ends) == (0, "東".encode(), [])
    assert not sync.healable("東".encode(), index)  # text is pending: nothing more to take back
    drafted = bpe.encode_fragment("東京都")  # 東京 | 都
    assert pieces(sp, sync.propose(drafted)) == ["京", "都"]
    assert sync.propose(bpe.encode_fragment("京都")) == []  # not a restatement of "東"
    keep, extra = sync.commit([sp_id(sp, "京"), sp_id(sp, "野")], drafted)
    assert keep == 1 and bpe.bytes_of(extra) == "野".encode()  # 東京 kept, 都 dropped, 野 re-encoded
    assert sync.committed.decode() == "東京野"
    assert not sync.healable("野".encode(), index)  # nothing in this vocabulary extends "野"


def test_healing_waits_while_a_character_is_pending(sp, bpe):
    """The target committed 東 and the first two bytes of 𠮷: the draft has not been shown the character yet, so
    nothing is healed; the draft restates the pending bytes, whose completion becomes single-byte pieces."""
    index = PrefixIndex(bpe.token_bytes)
    sync = TextSync(sp, bpe)
    sync.commit([sp_id(sp, "東"), sp_id(sp, "<0xF0>"), sp_id(sp, "<0xA0>")], drafted=[])
    assert sync.pending == b"\xf0\xa0" and not sync.healable("東".encode(), index)
    assert pieces(sp, sync.propose(bpe.encode_fragment("𠮷野"))) == ["<0xAE>", "<0xB7>", "野"]


def test_token_map_compares_bytes_not_strings(sp, bpe):
    tmap = build_token_map(bpe, sp, eos_pairs=[(0, 2)])
    (tokyo,) = bpe.encode_fragment("東京")
    (space_a,) = bpe.encode_fragment(" a")
    assert tmap.draft_to_target[tokyo] == sp_id(sp, "東京")
    assert tmap.draft_to_target[space_a] == sp_id(sp, "▁a")  # 'Ġa' and '▁a' are both b" a"
    assert tmap.draft_to_target[bpe.byte_ids[0xE4]] == sp_id(sp, "<0xE4>")
    assert tmap.draft_to_target[0] == 2
    # transformers' raw-string intersection (space marker swapped) matches no Japanese token of this pair:
    raw = {p.replace("Ġ", "▁") for p in bpe.tokenizer.get_vocab()} & set(sp.tokenizer.get_vocab())
    assert not any(any(ord(c) > 0x3000 for c in p) for p in raw)


def test_unsupported_tokenizer_is_named():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(XTokSpecError, match="wordy: cannot map its tokens to text"):
        TokenCodec(wrapped, name="wordy")


def test_utf8_helpers():
    data = "a東".encode()
    assert [utf8_valid_prefix_len(data[:n]) for n in range(5)] == [0, 1, 1, 1, 4]
    assert utf8_valid_prefix_len(b"ab\x80cd") == 2  # an invalid byte stops the valid prefix
    assert common_prefix_len(b"abcdef", b"abcxef") == 3 and common_prefix_len(b"ab", b"abc") == 2


# ---------------------------------------------------------------- properties on the fixture tokenizers
HOSTILE = "𠮷𩸽😀👨‍👩‍👧ｶﾞｷﾞＡＢＣか\u3099 \t\n  abc{}();自然言語処理東京"
texts = st.text(alphabet=st.sampled_from(HOSTILE) | st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)


@pytest.fixture(scope="module")
def fixture_codecs(sp_tokenizer, bpe_tokenizer):
    return TokenCodec(sp_tokenizer, name="ja-sp"), TokenCodec(bpe_tokenizer, name="ja-bpe")


@pytest.fixture(scope="module")
def fixture_index(fixture_codecs):
    return PrefixIndex(fixture_codecs[1].token_bytes)


@settings(max_examples=150, deadline=None, derandomize=True)  # same examples every run: CI never flakes
@given(lookbehind=st.integers(0, 3), text=texts, cuts=st.lists(st.integers(1, 6), min_size=1, max_size=30),
       noise=st.lists(st.booleans(), max_size=30), heal=st.lists(st.booleans(), max_size=30))
def test_sync_invariants_on_random_unicode(fixture_codecs, fixture_index, lookbehind, text, cuts, noise, heal):
    """Over random cycles, some of them healed: committed == bytes of target ids, the draft's context ==
    committed text up to its last complete character (before a cycle heals it), proposals restate drafted text,
    and the bridge never introduces U+FFFD."""
    target, draft = fixture_codecs
    target_ids = target.encode_fragment(text)
    truth = target.bytes_of(target_ids)
    sync = TextSync(target, draft, lookbehind)
    draft_cont: list[int] = []
    done = 0
    for n, cut in enumerate(cuts):
        if done >= len(target_ids):
            break
        if n < len(heal) and heal[n] and draft_cont and sync.healable(draft.token_bytes[draft_cont[-1]], fixture_index):
            sync.heal()
            draft_cont = draft_cont[:-1]
            assert draft.bytes_of(draft_cont) == sync.committed[: sync.synced]
            assert utf8_valid_prefix_len(sync.pending) == len(sync.pending) > 0
        seen_by_draft = truth[sync.synced :].decode("utf-8", errors="ignore")  # synced is a char boundary
        guess = seen_by_draft[: cut + 2] if not (n < len(noise) and noise[n]) else "x" + seen_by_draft[:cut]
        drafted = draft.encode_fragment(guess)
        drafted_bytes = draft.bytes_of(drafted)
        proposals = sync.propose(drafted)
        if drafted_bytes.startswith(sync.pending):
            assert drafted_bytes[len(sync.pending) :].startswith(target.bytes_of(proposals))
        else:
            assert proposals == []
        new = target_ids[done : done + cut]
        done += len(new)
        keep, extra = sync.commit(new, drafted)
        draft_cont = (draft_cont + drafted)[:keep] + extra
        assert sync.committed == truth[: len(sync.committed)] == target.bytes_of(target_ids[:done])
        complete = utf8_valid_prefix_len(sync.committed)
        assert draft.bytes_of(draft_cont) == sync.committed[:complete]
        assert "\ufffd" not in sync.committed[:complete].decode("utf-8") or "\ufffd" in text
    if done == len(target_ids):
        assert sync.committed.decode("utf-8") == text


def test_fragment_tokenizer_from_components_equals_the_json_copy(sp_tokenizer, bpe_tokenizer):
    """The fast fragment tokenizer (shared model, rebuilt components) encodes exactly as the full JSON copy."""
    from model_helpers import FIXTURES

    from xtokspec.text.codec import _fragment_tokenizer_from_json, fragment_tokenizer

    texts = (FIXTURES / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()[:200]
    texts += [" テスト", "a  b\tc", "<s>x</s><|endoftext|>", "𠮷😀", "\n\nが", "ｶﾀｶﾅ"]
    for tokenizer in (sp_tokenizer, bpe_tokenizer):
        fast = fragment_tokenizer(tokenizer.backend_tokenizer)
        exact = _fragment_tokenizer_from_json(tokenizer.backend_tokenizer)
        for text in texts:
            assert fast.encode(text, add_special_tokens=False).ids == exact.encode(text, add_special_tokens=False).ids


def test_fragment_tokenizer_keeps_interleaved_added_token_ids():
    """Special and ordinary added tokens outside the vocabulary, interleaved: re-added in id order, same ids."""
    from tokenizers import AddedToken, Tokenizer, models

    from xtokspec.text.codec import fragment_tokenizer

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    backend.add_tokens([AddedToken("zz", special=False)])
    backend.add_special_tokens([AddedToken("<x>", special=True)])
    backend.add_tokens([AddedToken("yy", special=False)])
    want = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    assert want == {"zz": 3, "<x>": 4, "yy": 5}
    fragment = fragment_tokenizer(backend)
    assert {name: fragment.token_to_id(name) for name in want} == want


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
def test_a_normalizing_draft_follows_text_its_normalizer_rewrites(form, sp):
    """A draft tokenizer with a normalizer (Qwen: NFC; others NFKC) cannot align its tokens with text that the
    normalizer rewrites ("か" + U+3099 -> "が"). The sync must go on: the draft sees its own normal form,
    charged to the right committed bytes, and never raises."""
    from tokenizers import normalizers

    draft_tok = vocabs.bpe_tokenizer()
    draft_tok.backend_tokenizer.normalizer = getattr(normalizers, form)()
    draft = TokenCodec(draft_tok)
    text = "\n\nか\u3099き\u3099東京ｶﾞ"
    ids, ends = draft.encode_stream(text)
    assert ends == sorted(ends) and ends[-1] == len(text.encode("utf-8"))
    got = draft.bytes_of(ids).decode("utf-8")  # the same text up to normalization
    assert unicodedata.normalize(form, got) == unicodedata.normalize(form, text) and got != text
    target = sp
    sync = TextSync(target, draft)
    keep, extra = sync.commit(target.encode_fragment(text), [])
    assert keep == 0 and extra == ids and sync.pending == b""
    more = "が東"
    keep, extra = sync.commit(target.encode_fragment(more), draft.encode_fragment(more))
    assert sync.synced == len((text + more).encode("utf-8"))


def test_added_whitespace_tokens_written_with_the_metaspace_stand_for_spaces():
    """Gemma-3's hub tokenizer.json adds the whitespace runs "▁▁", "▁▁▁", ... as (non-special) added tokens on
    top of a Replace(" ", "▁") normalizer; they stand for spaces, not for the character "▁"."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [(p, -2.0) for p in ["▁", "a", "b", "▁a", "東", "京", "と", "都", "改", "行", "\n", "\t", "c", "."]]
    vocab += [("▁" * n, -1.0) for n in (2, 3, 4)]  # in the model's vocabulary and declared added tokens, as in Gemma-3
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([AddedToken("▁" * n, normalized=False) for n in (2, 3, 4)])
    codec = TokenCodec(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>"), name="gemma-like")
    ids, ends = codec.encode_stream("a  b\t  c.    東京")
    assert codec.bytes_of(ids) == "a  b\t  c.    東京".encode()
    assert any(codec.token_bytes[i] == b"  " for i in ids)  # an added whitespace run was used, as two spaces


def test_first_pieces_on_the_fixture_tokenizers(fixture_codecs):
    """Every draft id's first target piece: the first id of the target's exact encoding of its text, or -1
    where the text is empty (specials) or not complete UTF-8 (byte-level ids that end inside a character)."""
    target, draft = fixture_codecs
    got = target.first_pieces(draft.token_bytes)
    assert len(got) == len(draft.token_bytes)
    for d, data in enumerate(draft.token_bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            assert got[d] == -1, d
            continue
        want = target.encode_exact(text)[:1] if text else []
        assert got[d] == (want[0] if want else -1), (d, text)
    assert sum(g >= 0 for g in got) > 0.8 * len(got)  # the table is not mostly empty


# ---------------------------------------------------------------- drafting that restates committed text
class ScriptedDraft:
    """A draft state whose next-token logits are a fixed preference order (V,), the same at every step."""

    def __init__(self, preference):
        import torch

        self.logits = torch.tensor(preference, dtype=torch.float32)[None]  # (1, V)
        self.ids: list[int] = []

    def forward(self, keep):
        return self.logits.clone()

    def feed(self, tokens):  # NOTE: as ModelState.feed, the ids are appended by the caller (extend)
        return self.logits.clone()

    def extend(self, ids):
        self.ids.extend(ids)

    def truncate(self, n):
        del self.ids[n:]


class Restating:
    """The mapper's side of a restatement: `restate` bytes pending, the draft ids that may restate them."""

    restrict, keeps_rows, kind = None, False, "greedy-bridge"

    def __init__(self, table, restate):
        self.index, self.restate, self.pending = PrefixIndex(table), restate, bool(restate)

    def allowed(self, remaining):
        return self.index.allowed(remaining)

    def heal_candidate(self, draft):
        return None

    def to_target(self, drafted, rows, eos):
        return list(drafted), None


class Healing(Restating):
    """A mapper whose draft may heal its last id `last`: the ids starting with its bytes may replace it."""

    def __init__(self, table, last):
        super().__init__(table, b"")
        self.table, self.last, self.healed = table, last, False

    def heal_candidate(self, draft):
        return self.last, self.index.starting_with(self.table[self.last])

    def heal(self, draft):
        self.healed, self.restate = True, self.table[self.last]
        draft.truncate(len(draft.ids) - 1)


class TwoRowDraft(ScriptedDraft):
    """A scripted draft whose logits before its last id (`forward_last`'s first row) are `before`."""

    def __init__(self, preference, before, ids):
        import torch

        super().__init__(preference)
        self.before = torch.tensor(before, dtype=torch.float32)[None]
        self.ids = list(ids)

    def forward_last(self, n):
        import torch

        return torch.cat([self.before, self.logits])


@pytest.mark.parametrize("greedy_path", ["host", "device"])
def test_healing_chooses_the_last_id_again_from_the_logits_before_it(greedy_path):
    """The draft's last id is "ab". Read without it, the draft prefers "abz" among the ids that start with "ab":
    that id takes its place and drafting goes on after it. Where it prefers "ab" itself, nothing is taken back and
    the first drafted id comes from the logits after "ab" (no forward more)."""
    from xtokspec.decode.propose import ChainProposer
    from xtokspec.types import Laps

    table = [b"", b"x", b"a", b"b", b"ab", b"abz", b"q"]
    after = [0.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # x first
    # NOTE: a draft confidence as good as none takes the host loop, one forward at a time
    confidence = 1e-9 if greedy_path == "host" else 0.0
    for k in (1, 3):
        for before, healed, first in (([0, 0, 0, 0, 1.0, 2.0, 9.0], True, b"abz"),
                                      ([0, 0, 0, 0, 2.0, 1.0, 9.0], False, b"x")):
            draft = TwoRowDraft(after, before, [2, 4])  # "a", "ab"
            mapper = Healing(table, 4)
            proposal = ChainProposer(set(), min_confidence=confidence, token_bytes=table).propose(
                draft, k, mapper, k, Laps())
            assert mapper.healed == healed == proposal.healed
            # after the first id, drafting is free again: the pending "ab" is restated by it
            assert [table[i] for i in proposal.draft_ids] == [first] + [b"x"] * (k - 1)
            assert draft.ids == [2] + ([] if healed else [4]) + proposal.draft_ids  # "ab" taken back where healed


@pytest.mark.parametrize("greedy_path", ["host", "device"])
def test_the_first_drafted_tokens_restate_the_pending_text(greedy_path):
    """The draft prefers "x" everywhere; with "ab" to restate, its first token is the one it likes best among
    those starting with "ab" ("abz" over "ab"), or, where none does, "a" then "b" (each a prefix of what remains);
    after the restatement it drafts freely again."""
    from xtokspec.decode.propose import ChainProposer
    from xtokspec.types import Laps

    table = [b"", b"x", b"a", b"b", b"ab", b"abz", b"q"]
    preference = [0.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # x, then q, abz, ab, b, a
    proposer = ChainProposer(set(), token_bytes=table)
    draft = ScriptedDraft(preference)
    if greedy_path == "host":
        drafted, *_ = proposer._draft(draft, 3, Restating(table, b"ab"))
    else:
        drafted = proposer.propose(draft, 3, Restating(table, b"ab"), 3, Laps()).draft_ids
    assert [table[i] for i in drafted] == [b"abz", b"x", b"x"]
    without_ab = table[:4] + [b"-", b"-", b"q"]  # no token starts with "ab": the host loop restates it in two
    drafted, *_ = ChainProposer(set(), token_bytes=without_ab)._draft(ScriptedDraft(preference), 4,
                                                                        Restating(without_ab, b"ab"))
    assert [without_ab[i] for i in drafted] == [b"a", b"b", b"x", b"x"]
    drafted = ChainProposer(set(), token_bytes=without_ab).propose(
        ScriptedDraft(preference), 4, Restating(without_ab, b"ab"), 4, Laps()).draft_ids
    assert [without_ab[i] for i in drafted] == [b"a", b"b", b"x", b"x"]  # propose takes the host loop then
