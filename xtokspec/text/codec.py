"""One tokenizer seen as raw UTF-8 bytes. Tokenizers and bytes only: no models, no tensors.

Every token id has the bytes it stands for in the middle of a stream (`TokenCodec.token_bytes`): byte-level BPE
symbols are mapped back through GPT-2's byte alphabet, SentencePiece "▁" is a space and `<0xNN>` is the byte NN,
special tokens stand for nothing. Continuations are encoded as fragments (`fragment_tokenizer`): no BOS and no
dummy-prefix "▁". The UTF-8 helpers here tell where characters start and end, so text is never cut inside one.
"""

from __future__ import annotations

import itertools
import json
import re
import unicodedata
from collections.abc import Sequence

from tokenizers import Tokenizer

from ..types import XTokSpecError

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Probe text every supported tokenizer must round-trip as a fragment (kana, kanji, Latin, spaces, newline).
_PROBES = ("自然言語処理とは何か", " 東京 と 京都\n", "a  b\tc. Hello, world!", "ｶﾀｶﾅ と ＡＢＣ")


def utf8_valid_prefix_len(data: bytes) -> int:
    """Length of the longest prefix of `data` that is complete, valid UTF-8."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as err:
        return err.start


def utf8_char_len(first_byte: int) -> int:
    """Bytes in the UTF-8 character starting with `first_byte` (1 for an invalid lead byte)."""
    if first_byte >= 0xF0:
        return 4
    if first_byte >= 0xE0:
        return 3
    if first_byte >= 0xC0:
        return 2
    return 1


def is_char_boundary(data: bytes, pos: int) -> bool:
    """True if a character starts at `pos` of `data` (or `pos` is the end)."""
    return pos >= len(data) or not 0x80 <= data[pos] < 0xC0


def _component_types(node: object) -> list[str]:
    """All "type" values in a tokenizer.json component tree (decoders and normalizers nest in Sequences)."""
    if isinstance(node, dict):
        return [node.get("type", "")] + [t for v in node.values() for t in _component_types(v)]
    if isinstance(node, list):
        return [t for v in node for t in _component_types(v)]
    return []


def _strip_prefix_space(node: object) -> object:
    """Copy of a normalizer/pre-tokenizer tree with dummy-prefix insertion turned off."""
    if isinstance(node, list):
        return [_strip_prefix_space(v) for v in node if not (isinstance(v, dict) and v.get("type") == "Prepend")]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "Prepend":
        return None
    out = {k: _strip_prefix_space(v) for k, v in node.items()}
    if out.get("type") == "Metaspace":
        out["prepend_scheme"] = "never"
        out.pop("add_prefix_space", None)
    if out.get("type") == "ByteLevel":
        out["add_prefix_space"] = False
    return out


def _state(component) -> object:
    """A tokenizers component's own JSON spec (None when absent): no serialization of the whole tokenizer."""
    return None if component is None else json.loads(component.__getstate__())


def _component(slot: str, spec: object):
    """A normalizer or pre-tokenizer rebuilt from its spec, through a one-word tokenizer (cheap)."""
    tiny = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}}
    tiny[slot] = spec
    return getattr(Tokenizer.from_str(json.dumps(tiny)), slot)


def fragment_tokenizer(backend: Tokenizer) -> Tokenizer:
    """A tokenizer sharing `backend`'s model that encodes continuations: no dummy prefix, no specials added.

    NOTE: built from the components, never from the whole tokenizer's JSON: a JSON round trip serialises the
    whole vocabulary, seconds for a 262k one. The added tokens are re-added in id order; if that does not reproduce their ids,
    the slow, exact JSON copy is used instead."""
    fragment = Tokenizer(backend.model)  # shares the model (no copy)
    for slot in ("normalizer", "pre_tokenizer"):
        spec = _strip_prefix_space(_state(getattr(backend, slot)))
        if spec is not None:
            setattr(fragment, slot, _component(slot, spec))
    if backend.decoder is not None:
        fragment.decoder = backend.decoder
    added = sorted(backend.get_added_tokens_decoder().items())
    for special, run in itertools.groupby((token for _, token in added), key=lambda token: token.special):
        (fragment.add_special_tokens if special else fragment.add_tokens)(list(run))  # in id order
    if all(fragment.token_to_id(token.content) == i for i, token in added):
        return fragment
    return _fragment_tokenizer_from_json(backend)


def _fragment_tokenizer_from_json(backend: Tokenizer) -> Tokenizer:
    """fragment_tokenizer through a full JSON copy of `backend` (slow for large vocabularies, always exact)."""
    spec = json.loads(backend.to_str())
    spec["normalizer"] = _strip_prefix_space(spec.get("normalizer"))
    spec["pre_tokenizer"] = _strip_prefix_space(spec.get("pre_tokenizer"))
    spec["post_processor"] = None
    return Tokenizer.from_str(json.dumps(spec))


class TokenCodec:
    """One tokenizer seen as bytes: id -> raw bytes, and fragment encoding without BOS or dummy prefix."""

    def __init__(self, tokenizer, vocab_size: int | None = None, name: str = "tokenizer"):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise XTokSpecError(f"{name}: xtokspec needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = max(vocab_size or 0, len(tokenizer))
        self.kind = self._kind(backend)
        # Unicode normal forms the tokenizer's normalizer applies (Qwen: NFC): its tokens stand for that form
        self.normal_forms = [t for t in _component_types(_state(backend.normalizer)) if t in ("NFC", "NFKC", "NFD", "NFKD")]
        self.special_ids = self._special_ids(tokenizer)
        self.token_bytes = self._token_bytes_table()  # list[bytes]; b"" for special and unused ids
        self.byte_ids = {tb[0]: i for i, tb in reversed(list(enumerate(self.token_bytes))) if len(tb) == 1}
        self._fragment = fragment_tokenizer(backend)
        self._check_round_trip()

    @staticmethod
    def _kind(backend: Tokenizer) -> str:
        types = _component_types(_state(backend.decoder)) + _component_types(_state(backend.pre_tokenizer))
        if "ByteLevel" in types:
            return "byte_level"
        if {"Metaspace", "ByteFallback", "Replace"} & set(types):
            return "sentencepiece"
        return "plain"

    @staticmethod
    def _special_ids(tokenizer) -> set[int]:
        ids = set(tokenizer.all_special_ids)
        ids |= {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
        return ids

    def _token_bytes_table(self) -> list[bytes]:
        byte_decoder = None
        if self.kind == "byte_level":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()}
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        table = [b""] * self.vocab_size
        for i, piece in enumerate(pieces):
            if i in self.special_ids or piece is None:
                continue
            if i in added:  # added tokens are literal text, with SentencePiece's "▁" for a space (Gemma-3's
                # whitespace runs "▁▁", "▁▁▁", ... are added tokens)
                text = added[i].replace("\u2581", " ") if self.kind == "sentencepiece" else added[i]
                table[i] = text.encode("utf-8")
            elif byte_decoder is not None:
                table[i] = bytes(byte_decoder.get(c, 0) for c in piece)
            elif self.kind == "sentencepiece" and (m := _BYTE_PIECE.match(piece)):
                table[i] = bytes([int(m.group(1), 16)])
            elif self.kind == "sentencepiece":
                table[i] = piece.replace("\u2581", " ").encode("utf-8")
            else:
                table[i] = piece.encode("utf-8")
        return table

    def _check_round_trip(self) -> None:
        for probe in _PROBES:
            ids = self.encode_fragment(probe)
            got = self.bytes_of(ids)
            normal = probe
            for form in self.normal_forms:
                normal = unicodedata.normalize(form, normal)
            if got not in (probe.encode("utf-8"), normal.encode("utf-8")):
                raise XTokSpecError(
                    f"{self.name}: cannot map its tokens to text (tokenizer kind {self.kind!r}): fragment "
                    f"{probe!r} encodes to {ids} which stand for {got!r}; xtokspec supports byte-level BPE and "
                    "SentencePiece-style tokenizers whose tokens concatenate to the text"
                )

    def encode_prompt(self, text: str, special: bool = True) -> list[int]:
        """The tokenizer's own default encoding (BOS where it adds one), as `tokenizer(text)` gives; `special=False`:
        none added (a chat template's text has its own)."""
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def encode_fragment(self, text: str) -> list[int]:
        """Ids of `text` as a continuation: no specials, no dummy prefix."""
        return self._fragment.encode(text, add_special_tokens=False).ids

    def bytes_of(self, ids: Sequence[int]) -> bytes:
        """The raw bytes a run of ids stands for (specials stand for nothing)."""
        table = self.token_bytes
        return b"".join(table[i] for i in ids)

    def first_pieces(self, texts: Sequence[bytes]) -> list[int]:
        """For each text (bytes), the id of the first token of its fragment encoding, if that token stands for
        the text's first bytes; -1 for empty text, text that is not complete UTF-8, or a first token that does not
        stand for its text (an <unk>, a normalizer's change). One batched encode."""
        out = [-1] * len(texts)
        valid = []
        for n, data in enumerate(texts):
            if data and utf8_valid_prefix_len(data) == len(data):
                valid.append(n)
        encodings = self._fragment.encode_batch([texts[n].decode("utf-8") for n in valid], add_special_tokens=False)
        for n, enc in zip(valid, encodings, strict=True):
            if enc.ids and (piece := self.token_bytes[enc.ids[0]]) and texts[n].startswith(piece):
                out[n] = enc.ids[0]
        return out

    def encode_exact(self, text: str) -> list[int]:
        """Fragment ids of `text`, cut before the first token whose bytes differ from the text (e.g. <unk>)."""
        ids = self.encode_fragment(text)
        data = text.encode("utf-8")
        pos = 0
        for n, i in enumerate(ids):
            piece = self.token_bytes[i]
            if not piece or data[pos : pos + len(piece)] != piece:
                return ids[:n]
            pos += len(piece)
        return ids

    def encode_stream(self, text: str) -> tuple[list[int], list[int]]:
        """Fragment ids of `text` and, per id, the end offset (in bytes of `text`) of what it covers.

        Ids that do not stand for their text (an <unk> for a character the tokenizer cannot encode) are
        charged the text their character offsets cover, so the stream still lines up with `text`. Where even
        the offsets do not line up (a normalizer that merges characters: NFC turns "か" + U+3099 into "が"),
        the text is encoded one character with its combining marks at a time, each unit's ids charged to its
        end: the draft then sees its own normal form of the text, which may cost acceptance, never the
        generation.
        """
        enc = self._fragment.encode(text, add_special_tokens=False)
        data = text.encode("utf-8")
        ends, pos = [], 0
        exact = True
        for i in enc.ids:
            piece = self.token_bytes[i]
            exact = exact and bool(piece) and data[pos : pos + len(piece)] == piece
            pos += len(piece)
            ends.append(pos)
        if exact and pos == len(data):
            return enc.ids, ends
        # Fallback through character offsets (an id covering no new characters covers nothing).
        char_end = [len(text[:e].encode("utf-8")) for _, e in enc.offsets]
        ends = [max(char_end[: n + 1]) for n in range(len(char_end))]
        if not ends or ends[-1] == len(data):
            return enc.ids, ends
        ids, ends, pos = [], [], 0
        for unit in _units(text):
            unit_ids = self._fragment.encode(unit, add_special_tokens=False).ids
            pos += len(unit.encode("utf-8"))
            ids += unit_ids
            ends += [pos] * len(unit_ids)
        return ids, ends


def _units(text: str) -> list[str]:
    """`text` cut before every character that is not a combining mark (a base with its marks stays whole)."""
    units: list[str] = []
    for char in text:
        if units and unicodedata.category(char).startswith("M"):
            units[-1] += char
        else:
            units.append(char)
    return units


def byte_ends(table: list[bytes], ids: list[int]) -> list[int]:
    """Running end offsets of the bytes of `ids`."""
    out, pos = [], 0
    for i in ids:
        pos += len(table[i])
        out.append(pos)
    return out
