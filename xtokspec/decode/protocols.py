"""The interfaces the loop is written against: what a mapper, a proposer and a policy must offer.

The loop (`loop.Run`) and the vLLM proposer hold these, never a concrete class: `mapping` has four mappers,
`propose` two proposers, `policy` the measured policies, and a test or a user may hand in its own (a scripted
fallback, `XTokSpec.fallback_policy`). Shape legend: Vd the draft's vocabulary, Vt the target's, K the proposals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..runtime.cache import ModelState
    from ..types import CycleRecord, Laps
    from .propose import Proposal


@runtime_checkable
class Mapper(Protocol):
    """Moves drafted ids onto the target's vocabulary and the draft's context back onto the committed text."""

    kind: str  # the proposal kind a cycle reports (types.ProposalKind's value)
    keeps_rows: bool  # sampling: whether the verifier is given the draft's distributions (else one-hot)

    @property
    def current(self) -> Mapper:
        """The mapper this cycle runs (itself, except for one that switches between two)."""

    @property
    def pending(self) -> bool:
        """Committed bytes the draft has not been shown yet."""

    @property
    def restate(self) -> bytes:
        """The bytes the drafted text must start with (b"": none)."""

    @property
    def restrict(self) -> torch.Tensor | None:
        """A mask on the draft's distribution (the ids a proposal may be), or None."""

    def allowed(self, remaining: bytes) -> tuple[list[int], bool]:
        """The draft ids the next drafted token may be while `remaining` bytes are still to restate."""

    def heal_candidate(self, draft: ModelState) -> tuple[int, list[int]] | None:
        """Token healing's candidate at a cycle start, or None."""

    def to_target(self, drafted: list[int], rows: list[torch.Tensor], eos: bool) -> tuple[list[int], torch.Tensor | None]:
        """Drafted ids -> (target ids, their proposal distributions (K, Vt), or None for one-hot)."""

    def branch_to_target(self, path: list[int], eos: bool, first: int | None = None) -> list[int]:
        """A tree branch's draft ids -> its target ids."""

    def node_values(self, path: list[int], scores: list[float], target_ids: list[int]) -> list[float]:
        """Each target id's estimated chance of acceptance."""

    def commit(self, draft: ModelState, drafted: list[int], new_ids: list[int]) -> None:
        """Bring the draft's ids and cache to the committed text, keeping the drafted ids that agree with it."""

    def slide(self, draft: ModelState, n: int) -> None:
        """Forget the draft's oldest n ids (after its head) and re-prefill the rest."""

    def first_chances(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> tuple[float, float] | None:
        """What a cycle's record carries for a policy that chooses the mapper (None: nothing to choose)."""


@runtime_checkable
class MapperChoice(Protocol):
    """What a generation holds: the mapper each cycle runs (`current`; a mapper is its own, `mapping.Switching`
    chooses one of two), and what a verified cycle's record carries for that choice."""

    @property
    def current(self) -> Mapper: ...

    def first_chances(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> tuple[float, float] | None:
        """The proposal kinds' chances of acceptance at a cycle's first position, or None (nothing to choose)."""


@runtime_checkable
class Proposer(Protocol):
    def propose(self, draft: ModelState, k: int, mapper: Mapper, room: int, laps: Laps) -> Proposal:
        """Draft up to k ids and map them; at most `room` proposals (a tree: its depth) reach the verifier."""


@runtime_checkable
class Observer(Protocol):
    def observe(self, cycle: CycleRecord) -> None:
        """Learn from one cycle's record (every cycle's, drafted or target-alone)."""


@runtime_checkable
class DraftLengthPolicy(Observer, Protocol):
    def next_k(self) -> int:
        """The number of draft tokens the next cycle drafts."""


@runtime_checkable
class FallbackPolicy(Observer, Protocol):
    def run_alone(self) -> bool:
        """Whether the next cycle runs the target alone."""
