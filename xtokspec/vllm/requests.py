"""Requests found again from their token ids alone: vLLM hands its proposer rows with no request ids, and a
request's row moves between steps (the rule: xtokspec/vllm/proposer.py's module docstring). `RequestTable` pairs each row
with the state it had, by the longest prefix of its ids, one state per row.

Entries are indexed by what they last saw (its length and last few ids), and a row grows by at most `max_new` ids
between two calls (vLLM commits at most K + 1 per step), so a row looks up at most `max_new` + 1 keys and compares
its ids only with the entries found there: a call costs O(rows), not O(rows x entries). A row that grew by more
gets a new entry, which costs acceptance (its draft prefills again), never correctness."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Entry:
    """One request's state as the table sees it: the target ids it has seen, and the caller's payload."""

    raw: bytes = b""  # the row's ids when it was last matched, as bytes (compared with a row's prefix in one step)
    dtype: np.dtype | None = None  # their dtype
    payload: object = None  # the caller's per-request state (None until the caller sets it)
    idle: int = 0  # consecutive propose calls in which no row matched it
    number: int = field(default=0)  # creation order: ties between equal matches go to the older entry
    key: tuple | None = None  # its key in the table's index (None: not indexed)

    @property
    def ids(self) -> np.ndarray:
        """(n,) the ids it has seen (read only)."""
        return np.frombuffer(self.raw, dtype=self.dtype if self.dtype is not None else np.int64)


def key(ids, n: int, start: int = 0) -> tuple:
    """What the index keys an entry that saw n ids by: n and its last (up to) 4 ids. `ids`: a list of the ids
    from position `start` on (the last 4 of the n among them)."""
    return n, *ids[max(0, n - 4) - start : n - start]


class RequestTable:
    """Per-request states found again from token ids (the rule: this module's docstring)."""

    def __init__(self, idle_calls: int = 4, max_states: int = 1024, on_drop=None, max_new: int = 64):
        """`on_drop(payload)`: called with each dropped entry's payload (to hand its resources back); `max_new`: the
        most ids a row can gain between two calls."""
        if idle_calls < 0 or max_states < 1 or max_new < 0:
            raise ValueError(f"need idle_calls >= 0, max_states >= 1 and max_new >= 0, got {idle_calls}, "
                             f"{max_states}, {max_new}")
        self.idle_calls, self.max_states, self.max_new = idle_calls, max_states, max_new
        self.on_drop = on_drop
        self.entries: list[Entry] = []
        self.index: dict[tuple, list[Entry]] = {}  # key(ids seen) -> entries, oldest first
        self.created = self.dropped = 0
        self.comparisons = 0  # rows' ids compared with an entry's (what a call costs, counted by the tests)

    def assign(self, rows: Sequence[np.ndarray | None]) -> list[tuple[Entry, int] | None]:
        """For each row (its ids, or None for a row that wants no proposal): (its entry, how many of the row's ids
        the entry had seen: 0 for a new entry) -> the entry's `ids` become the row's. Entries that no row matched
        age by one call; those idle more than `idle_calls`, then the longest idle past `max_states`, are dropped."""
        index = self.index
        pairs = []  # (-matched length, entry number, row, entry)
        tails = {}  # row -> (its last ids as a list, where they start)
        left = {}  # row -> the longest length not yet looked up (a row stops at its longest match at first)
        for r, row in enumerate(rows):
            if row is None:
                continue
            length = len(row)
            low = max(0, length - self.max_new - 1)
            offset = max(0, low - 3)
            tails[r] = row[offset:length].tolist(), offset  # the ids all its keys are made of, out of numpy once
            left[r] = self._look(r, row, tails[r], length, pairs)
        # NOTE: a row's shorter matches matter only where its longest ones went to other rows (identical prompts):
        # those rows look further and the longest-first choice runs again, as if every match had been seen
        while True:
            out = self._choose(pairs, len(rows))
            short = [r for r, n in left.items() if out[r] is None and n is not None]
            if not short:
                break
            for r in short:
                left[r] = self._look(r, rows[r], tails[r], left[r], pairs)
        taken = {id(hit[0]) for hit in out if hit is not None}
        for e in self.entries:
            e.idle = 0 if id(e) in taken else e.idle + 1
        for r, row in enumerate(rows):
            if row is None:
                continue
            if out[r] is None:
                e = Entry(number=self.created)
                self.created += 1
                self.entries.append(e)
                out[r] = (e, 0)
            e = out[r][0]
            self._unindex(e)
            e.raw, e.dtype = row.tobytes(), row.dtype
            tail, offset = tails[r]
            e.key = key(tail, len(row), offset)
            # NOTE: each bucket oldest first: ties between equal matches go to the older entry
            bucket = index.setdefault(e.key, [])
            if bucket and bucket[-1].number > e.number:
                bisect.insort(bucket, e, key=lambda x: x.number)
            else:
                bucket.append(e)
        self._drop()
        return out

    def _look(self, r: int, row: np.ndarray, tail: tuple[list, int], high: int, pairs: list) -> int | None:
        """Add row r's matches (entries that saw its first n ids) at the longest n from `high` down to the
        shortest a row can have grown from (`max_new`) that has any -> the next n to look at after it (None: none
        left)."""
        ids, offset = tail
        index = self.index
        low = max(0, len(row) - self.max_new - 1)
        for n in range(high, low, -1):
            found = index.get(key(ids, n, offset))
            if not found:
                continue
            prefix = row[:n].tobytes()  # NOTE: one C comparison per entry found (numpy's are slower calls)
            matched = False
            for e in found:
                self.comparisons += 1
                if e.dtype == row.dtype and e.raw == prefix:
                    pairs.append((-n, e.number, r, e))
                    matched = True
            if matched:
                return n - 1 if n - 1 > low else None
        return None

    @staticmethod
    def _choose(pairs: list, rows: int) -> list[tuple[Entry, int] | None]:
        """Longest matches first, then older entries, then lower rows: each row and each entry taken once."""
        pairs.sort(key=lambda p: p[:3])
        out: list[tuple[Entry, int] | None] = [None] * rows
        taken: set[int] = set()
        for neg_n, _, r, e in pairs:
            if out[r] is None and id(e) not in taken:
                out[r] = (e, -neg_n)
                taken.add(id(e))
        return out

    def _unindex(self, entry: Entry) -> None:
        if entry.key is not None:
            bucket = self.index.get(entry.key, [])
            if entry in bucket:
                bucket.remove(entry)
            if not bucket:
                self.index.pop(entry.key, None)
            entry.key = None

    def discard(self, entry: Entry) -> None:
        """Drop one entry now (its payload handed to `on_drop`): a row that matched it gets a new entry next time.
        An entry already dropped is left alone (its payload was handed back once)."""
        if not any(e is entry for e in self.entries):
            return
        self.entries = [e for e in self.entries if e is not entry]
        self._unindex(entry)
        self.dropped += 1
        if self.on_drop is not None and entry.payload is not None:
            self.on_drop(entry.payload)

    def _drop(self) -> None:
        keep = [e for e in self.entries if e.idle <= self.idle_calls]
        if len(keep) > self.max_states:
            keep.sort(key=lambda e: (e.idle, -e.number))
            keep = keep[: self.max_states]
            keep.sort(key=lambda e: e.number)
        self.dropped += len(self.entries) - len(keep)
        if len(keep) < len(self.entries):
            kept = {id(e) for e in keep}
            for e in self.entries:
                if id(e) not in kept:
                    self._unindex(e)
                    if self.on_drop is not None and e.payload is not None:
                        self.on_drop(e.payload)
        self.entries = keep


class Queue:
    """Whether requests wait for a slot, seen from the rows alone (no scheduler state reaches a proposer).

    A step at the scheduler's limit of running requests (`max_num_seqs`) may have requests waiting or not: a batch
    that arrived together and fills the limit has none. What tells them apart is a request leaving such a step
    (finished, aborted, preempted): if a request was waiting, the scheduler admits it at the next step (its row new,
    or still prefilling); if none was, the next step runs with fewer. The last such evidence holds until the next;
    before any, none is taken to wait (the policy's careful rule: decode.stepcosts, the slowest request's pace)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.waiting = False
        self.rows = 0  # the last call's rows
        self.matched = 0  # of those, the rows matched to a request (new or not)

    def observe(self, rows: int, kept: int, matched: int) -> bool:
        """A call's `rows`: `kept` matched to a request seen before (the others new or still prefilling, no ids
        yet), `matched` matched to a request (new or not) -> whether the step it chooses lengths for runs at the
        limit with requests waiting."""
        if self.rows >= self.limit and kept < self.matched:  # a request left a step at the limit
            self.waiting = rows > kept  # another came in at once
        self.rows, self.matched = rows, matched
        return self.waiting and rows >= self.limit
