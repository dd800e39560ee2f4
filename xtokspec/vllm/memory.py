"""The draft caches' memory inside vLLM: counted from the positions each request's draft cache holds (a static
cache: all it allocated), and held within a bound (`additional_config["xtokspec_draft_cache_mib"]`): past it,
idle static caches go first, then requests' states, the longest idle first, then the largest (a request that
lost its state rebuilds it, one chunk per step, when it drafts again)."""

from __future__ import annotations

from ..runtime.kv import position_bytes


class DraftMemory:
    """The bound on the requests' draft caches together, and what they hold now."""

    def __init__(self, draft_model, mib: float):
        self.model = draft_model
        self.bound = int(mib * 2**20)
        self.position_bytes = position_bytes(draft_model)

    def state_bytes(self, request) -> int:
        """The memory of a request's (`drafts.RequestDraft`) draft cache."""
        state = request.state
        if state is None:  # not built: the request has not drafted yet
            return 0
        positions = state.kv.capacity if state.backend == "static" else len(state.ids)
        return positions * self.position_bytes

    def total(self, table, kept) -> int:
        """Every kept request's cache (`table`: the proposer's `RequestTable`) and the idle static caches kept for
        new requests (`kept`: its `assemble.Kept`)."""
        idle = sum(kv.capacity for kv in kept.idle_kv.get(id(self.model), ())) * self.position_bytes
        return idle + sum(self.state_bytes(e.payload) for e in table.entries if e.payload is not None)

    def enforce(self, table, kept) -> int:
        """Bring `total` within the bound -> how many requests lost their state (a dropped static cache is not
        kept for reuse then)."""
        if self.total(table, kept) <= self.bound:
            return 0
        idle = kept.idle_kv.get(id(self.model), [])
        idle.clear()
        states = [e for e in table.entries if e.payload is not None]
        held = sum(self.state_bytes(e.payload) for e in states)
        evicted = 0
        for entry in sorted(states, key=lambda e: (-e.idle, -self.state_bytes(e.payload))):
            if held <= self.bound:
                break
            held -= self.state_bytes(entry.payload)
            table.discard(entry)
            evicted += 1
        idle.clear()
        return evicted
