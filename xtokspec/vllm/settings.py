"""The proposer's settings, read from vLLM's `additional_config` (and two environment variables), each checked
with an error that names its key; and what the proposer did (`ProposerStats`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..types import XTokSpecError, is_int

DRAFT_KEY = "xtokspec_draft"  # additional_config key naming the draft (a folder, a hub id, a bundled name)
DRAFT_ENV = "XTOKSPEC_DRAFT"  # the environment variable that does the same (additional_config wins)
DTYPE_KEY, DTYPE_ENV = "xtokspec_draft_dtype", "XTOKSPEC_DRAFT_DTYPE"  # default: the target's dtype in vLLM
BATCHED_KEY = "xtokspec_batched_drafts"  # False: one draft forward per request (default: batched, see draft_together)
# True: each request's draft steps recorded as CUDA graphs over a static cache of its own; default: so on a GPU
# where every running request's static cache fits the draft caches' bound (MEMORY_KEY)
GRAPHS_KEY = "xtokspec_draft_graphs"
CACHE_KEY = "xtokspec_draft_cache"  # "dynamic" (default) or "static": each request's draft cache, see RequestDraft
CACHE_LEN_KEY = "xtokspec_draft_cache_len"  # a static draft cache's positions (default: 2 x vLLM's max_model_len)
# a trimmed draft head (XTokSpec.trim_draft_vocab): the calibration text file its ids are chosen from, one text a
# line, and how many ids it keeps (default 32768); no file: the full head
TRIM_TEXT_KEY, TRIM_SIZE_KEY = "xtokspec_draft_vocab_text", "xtokspec_draft_vocab"
# "int8": the draft's linears (its trimmed head too) quantized to int8 on the CPU (runtime.models.int8_linears), for a
# draft whose step streams its float32 weights; default "torch": as loaded
LINEARS_KEY = "xtokspec_draft_linears"
DRAFT_LINEARS = ("torch", "int8")
MEMORY_KEY = "xtokspec_draft_cache_mib"  # the requests' draft caches together, at most (default 1024 MiB)
CHUNK_KEY = "xtokspec_prefill_chunk"  # ids a request's draft reads per step at most (a long prompt over several)
# the most recent target ids of a request's text its draft reads when it is built (default: all): a draft reading
# less context may follow the text less well, and costs less to start (BENCHMARKS.md, "vLLM")
READ_KEY = "xtokspec_draft_read"
HEALING_KEY = "xtokspec_draft_healing"  # False: no token healing (SpecConfig.draft_healing; default: heal)
# False: vLLM prepares steps without drafts on its speculative path (default: as without it; vllm/cpu_sampling.py)
PLAIN_KEY = "xtokspec_plain_steps"
ADAPTIVE_KEY = "xtokspec_adaptive"  # False: every request drafts num_speculative_tokens every step (default: chosen)
IDLE_KEY = "xtokspec_idle_calls"  # propose calls a request's state outlives its last row (default 4)


@dataclass
class ProposerSettings:
    """What `additional_config` asks of the proposer, checked."""

    draft: str
    dtype: torch.dtype
    batched: bool = True
    graphs: bool | None = None  # None: chosen by the proposer (GRAPHS_KEY)
    cache: str | None = None  # None: "static" with graphs, else "dynamic"
    cache_len: int | None = None  # None: 2 x vLLM's max_model_len, at least 256
    trim_text: str | None = None
    trim_size: int = 32768
    linears: str = "torch"
    memory_mib: float = 1024
    prefill_chunk: int = 64
    read_ids: int | None = None  # None: a new request's draft reads its whole text (READ_KEY)
    healing: bool = True
    plain_steps: bool = True
    adaptive: bool = True
    idle_calls: int = 4

    @classmethod
    def read(cls, extra: dict, default_dtype, draft=None) -> ProposerSettings:
        """`extra`: vLLM's `additional_config` (a dict, empty where none was given)."""
        draft = draft or extra.get(DRAFT_KEY) or os.environ.get(DRAFT_ENV)
        if not draft:
            raise XTokSpecError(
                f"xtokspec's vLLM proposer needs a draft model: pass additional_config={{'{DRAFT_KEY}': "
                f"'path/to/draft'}} (vllm serve: --additional-config '{{\"{DRAFT_KEY}\": \"path/to/draft\"}}') or "
                f"set {DRAFT_ENV}"
            )
        named = extra.get(DTYPE_KEY) or os.environ.get(DTYPE_ENV)
        dtype = named or default_dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise XTokSpecError(f"{DTYPE_KEY} / {DTYPE_ENV}: not a torch dtype: {named!r}")
        cache = extra.get(CACHE_KEY)
        if cache not in (None, "dynamic", "static"):
            raise XTokSpecError(f"{CACHE_KEY}: 'dynamic' or 'static', got {cache!r}")
        cache_len = extra.get(CACHE_LEN_KEY)
        if cache_len is not None and (not is_int(cache_len) or cache_len < 64):
            raise XTokSpecError(f"{CACHE_LEN_KEY}: an integer of at least 64 positions, got {cache_len!r}")
        trim_size = extra.get(TRIM_SIZE_KEY, 32768)
        if not is_int(trim_size) or trim_size < 1:
            raise XTokSpecError(f"{TRIM_SIZE_KEY}: a positive number of ids, got {trim_size!r}")
        linears = extra.get(LINEARS_KEY) or "torch"
        if linears not in DRAFT_LINEARS:
            raise XTokSpecError(f"{LINEARS_KEY}: one of {', '.join(map(repr, DRAFT_LINEARS))}, got {linears!r}")
        if linears == "int8" and dtype != torch.float32:
            raise XTokSpecError(f"{LINEARS_KEY}='int8' quantizes a float32 draft: the draft loads in "
                                f"{str(dtype).removeprefix('torch.')} (set {DTYPE_KEY}='float32')")
        chunk = extra.get(CHUNK_KEY, 64)
        if not is_int(chunk) or chunk < 1:
            raise XTokSpecError(f"{CHUNK_KEY}: a positive number of ids, got {chunk!r}")
        mib = extra.get(MEMORY_KEY, 1024)
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or mib <= 0:
            raise XTokSpecError(f"{MEMORY_KEY}: a positive number of MiB, got {mib!r}")
        read_ids = extra.get(READ_KEY)
        if read_ids is not None and (not is_int(read_ids) or read_ids < 8):
            raise XTokSpecError(f"{READ_KEY}: a number of target ids, 8 or more (or None: all), got {read_ids!r}")
        idle = extra.get(IDLE_KEY, 4)
        if not is_int(idle) or idle < 0:
            raise XTokSpecError(f"{IDLE_KEY}: a number of calls, 0 or more, got {idle!r}")
        return cls(draft=str(draft), dtype=dtype, batched=bool(extra.get(BATCHED_KEY, True)),
                   graphs=None if extra.get(GRAPHS_KEY) is None else bool(extra[GRAPHS_KEY]), cache=cache, cache_len=cache_len,
                   trim_text=extra.get(TRIM_TEXT_KEY) or None, trim_size=trim_size, linears=linears, memory_mib=mib,
                   prefill_chunk=chunk, read_ids=read_ids, healing=bool(extra.get(HEALING_KEY, True)),
                   plain_steps=bool(extra.get(PLAIN_KEY, True)),
                   adaptive=bool(extra.get(ADAPTIVE_KEY, True)), idle_calls=idle)


@dataclass
class ProposerStats:
    """What the proposer did, summed over its propose calls (`TextBridgeProposer.stats`)."""

    calls: int = 0  # propose calls
    rows: int = 0  # rows that were given a chance to propose
    drafting_rows: int = 0  # of those, the rows the policy let draft (decode.rows.RowDraftLengths)
    proposed: int = 0  # target ids proposed
    accepted: int = 0  # of those, accepted by vLLM (seen in the ids it commits next)
    draft_forwards: int = 0  # drafted ids (one forward per drafted id, per request, when not batched)
    batched_forwards: int = 0  # forwards over several requests at once (draft_together)
    copy_s: float = 0.0  # seconds copying the requests' draft caches into a batch and back (draft_together)
    new_states: int = 0  # requests whose draft prefilled from scratch
    evicted: int = 0  # requests whose draft state went to keep the draft caches within their bound
    prefill_chunks: int = 0  # steps in which a request's draft read a chunk of a long text instead of drafting
    healed: int = 0  # proposals whose first drafted id replaced the draft's last one (token healing)
    quiet_calls: int = 0  # calls in which no row drafted
    skipped: int = 0  # of those, calls the policy knew would draft nothing: rows not matched then (proposer._skip)
    plain_steps: int = 0  # steps vLLM prepared as without speculative decoding (nothing drafted: cpu_sampling)
    quiet_s: float = 0.0  # seconds those calls took (matching rows and bookkeeping: a step without drafts costs this)
    faults: int = 0  # requests that got no proposal because drafting for them failed (logged once per kind)
    draft_s: float = 0.0  # seconds in the draft's forwards
    bridge_s: float = 0.0  # seconds mapping drafted ids onto the target's vocabulary
    other_s: float = 0.0  # seconds matching rows, committing and creating states (prefills included)

    @property
    def total_s(self) -> float:
        return self.draft_s + self.bridge_s + self.other_s + self.copy_s
