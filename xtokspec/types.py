"""Plain data: sampling parameters, decoding config, per-call statistics and results (and eq. 1 of the paper).

Nothing here knows about torch or transformers; every other module imports from here.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PROPOSAL_KINDS = ("auto", "onehot", "intersection")


def is_int(value) -> bool:
    """An int that is not a bool (True passes isinstance(..., int), and is no count of anything)."""
    return isinstance(value, int) and not isinstance(value, bool)


class ProposalKind(enum.Enum):
    """How a generation's proposals reach the target (options.proposal_kind chooses; decode.assemble builds the
    mapper for it). The value is the name statistics and reports show."""

    SAME_TOKENIZER = "same-tokenizer"  # one tokenizer: the draft's ids and distributions are the target's
    GREEDY_BRIDGE = "greedy-bridge"  # two tokenizers, greedy: drafted text re-encoded as target ids
    ONEHOT = "onehot"  # two tokenizers, sampling: the same, proposed one-hot
    INTERSECTION = "intersection"  # sampling: ids with the same bytes in both vocabularies, with the draft's probs
    AUTO = "auto"  # sampling: one-hot or intersection, chosen each cycle (policy.ProposalChooser)
CACHE_CHOICES = ("auto", "dynamic", "static")
# SpecConfig.compile: "auto" (CUDA graphs on a GPU where the models allow them, eager elsewhere), "graphs" (CUDA
# graphs), "inductor" (torch.compile; True means the same), False (eager)
COMPILE_CHOICES = ("auto", "graphs", "inductor", True, False)
TREE_ROOTS = ("sampled", "top")  # a sampled tree's root candidates: drawn from the draft, or its likeliest ones
# Why a generation ended: the target emitted EOS; max_new_tokens were produced; or the target's context
# (max_position_embeddings) is full, so the target alone could not have gone on either.
STOP_REASONS = ("eos", "length", "context")


class XTokSpecError(ValueError):
    """Bad input or an unsupported model/tokenizer: the message names the problem."""


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next token is chosen; the meaning is transformers' `generate`.

    With do_sample=False decoding is greedy (argmax of the raw logits). With do_sample=True the logits go
    through temperature, then top-k (0 disables), then top-p (1.0 disables), then softmax.
    """

    do_sample: bool = False
    temperature: float = 1.0  # > 0; divides the logits
    top_k: int = 0  # keep tokens whose logit >= the k-th largest (ties kept); 0 = off
    top_p: float = 1.0  # nucleus: smallest set with cumulative prob >= top_p; 1.0 = off
    seed: int | None = None  # seeds this call's generators; None draws from torch's global RNG
    # sampling keyed by (seed, output position): the same seed gives the same text whatever the draft, K, trees or
    # fallback (decode/keyed.py); False: the random streams of the proven rejection rules
    keyed: bool = False

    def __post_init__(self) -> None:
        # NOTE: checked whether or not we sample: an invalid value is a mistake either way. Greedy decoding
        # ignores the values (transformers' generate warns about them), and accepts temperature 0, the usual
        # way of asking for greedy output.
        if not isinstance(self.do_sample, bool):
            raise XTokSpecError(f"do_sample must be True or False, got {self.do_sample!r}")
        if isinstance(self.temperature, bool) or not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
        ):
            raise XTokSpecError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise XTokSpecError(f"temperature must be >= 0 (0 means greedy decoding), got {self.temperature}")
        if self.do_sample and self.temperature == 0:
            raise XTokSpecError(
                "temperature must be > 0 when sampling; temperature 0 means greedy decoding: use do_sample=False"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise XTokSpecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise XTokSpecError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not isinstance(self.keyed, bool):
            raise XTokSpecError(f"keyed must be True or False, got {self.keyed!r}")
        if self.keyed and not self.do_sample:
            raise XTokSpecError("keyed=True is a way of sampling: pass do_sample=True with it (greedy decoding is "
                                "the same text whatever the draft already)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise XTokSpecError(f"seed must be an integer or None, got {self.seed!r}")


def check_prompt(prompt) -> None:
    """Raise XTokSpecError unless `prompt` is non-empty text that encodes as UTF-8 (cheap: run it first)."""
    if not isinstance(prompt, str):
        raise XTokSpecError(f"prompt must be a str, got {type(prompt).__name__}")
    if not prompt:
        raise XTokSpecError("prompt is empty: give at least one character of text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise XTokSpecError(
            f"prompt is not valid Unicode text: character {err.start} is {prompt[err.start]!r}, a lone surrogate "
            "(half of a UTF-16 pair, e.g. from a broken decode); no tokenizer can encode it"
        ) from None


@dataclass(frozen=True)
class SpecConfig:
    """Speculation knobs; defaults are the ones the benchmarks found best on the fixture pair."""

    num_draft_tokens: int = 4  # K at the start of the first generation with a setting (and always, when adaptive=False)
    max_draft_tokens: int = 12  # upper bound for the adaptive choice of K
    adaptive: bool = True  # choose K each cycle from measured costs and acceptance
    draft_confidence: float = 0.0  # stop drafting early when the draft's probability of its token is below this
    # kept draft ids re-encoded together with new committed text, so that the draft's recent context is split as
    # its own tokenizer would split the whole text (the draft predicts best after its own boundaries)
    draft_lookbehind: int = 2
    # two tokenizers, chains, greedy or one-hot cycles (proposal "onehot", "auto"): at each cycle start the draft
    # chooses its last token of the committed text again, among those starting with its text, and a longer one
    # replaces it (token healing: the committed text ends on a target-token boundary, often inside one of the
    # draft's own tokens)
    draft_healing: bool = True
    proposal: str = "auto"  # sampling across tokenizers: "onehot", "intersection" or "auto" (chosen each cycle)
    min_mapped_mass: float = 0.5  # "auto" starts with intersection when >= this share of the draft vocabulary maps
    cache: str = "auto"  # KV cache backend per model: "dynamic", "static" (preallocated), "auto" = static on CUDA
    # both models' short forwards as fixed-shape steps on the static cache: "graphs" recorded as CUDA graphs and
    # replayed (seconds to capture), "inductor" (or True) through torch.compile (minutes on a GPU), False eager;
    # "auto": graphs on CUDA where the models allow them (full attention, sdpa/eager attention), eager elsewhere
    compile: bool | str = "auto"
    tree_width: int = 1  # token trees: drafted candidates kept at each depth (1 = a single chain, no tree)
    # sampled trees: the root's tree_width candidates drawn from the draft without replacement and tested against
    # its distribution ("sampled"), or its likeliest ones tested one-hot ("top"); greedy trees always take the top
    tree_root: str = "sampled"
    max_tree_nodes: int = 64  # most target-token nodes one tree verification carries
    prune_tree: bool = True  # with adaptive: verify only the drafted nodes worth their measured cost
    # with adaptive: run the target alone (no draft) while the measured seconds per committed token say drafting
    # does not pay on this hardware, with a drafted cycle every few to notice when it does again
    fallback: bool = True
    # most draft tokens of context the draft holds (None: its own limit): past it the draft keeps drafting from the
    # most recent text, re-prefilled half the window at a time; it also caps what the draft prefills of a long
    # prompt: a draft proposes from the recent text, and its cache and prefill grow with all of it (the memory
    # and acceptance at 1,024 against the whole prompt: BENCHMARKS.md, "Long prompts")
    draft_context: int | None = 1024

    def __post_init__(self) -> None:
        for name in ("num_draft_tokens", "max_draft_tokens"):
            value = getattr(self, name)
            if not is_int(value):
                raise XTokSpecError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.num_draft_tokens <= self.max_draft_tokens:
            raise XTokSpecError(
                f"need 1 <= num_draft_tokens <= max_draft_tokens, got {self.num_draft_tokens}, {self.max_draft_tokens}"
            )
        if self.proposal not in PROPOSAL_KINDS:
            raise XTokSpecError(f"proposal must be one of {PROPOSAL_KINDS}, got {self.proposal!r}")
        if not any(self.compile is choice or (isinstance(choice, str) and self.compile == choice)
                   for choice in COMPILE_CHOICES):
            raise XTokSpecError(
                "compile must be 'auto' (CUDA graphs on a GPU where the models allow them, else eager), 'graphs', "
                f"'inductor' (torch.compile; True means the same) or False (eager), got {self.compile!r}")
        for name in ("adaptive", "prune_tree", "fallback", "draft_healing"):
            if not isinstance(getattr(self, name), bool):
                raise XTokSpecError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.tree_root not in TREE_ROOTS:
            raise XTokSpecError(f"tree_root must be one of {TREE_ROOTS}, got {self.tree_root!r}")
        if self.cache not in CACHE_CHOICES:
            raise XTokSpecError(f"cache must be one of {CACHE_CHOICES}, got {self.cache!r}")
        if self.compile in (True, "inductor", "graphs") and self.cache == "dynamic":
            raise XTokSpecError(f"compile={self.compile!r} needs the static cache (fixed shapes): use cache='static' "
                                "or 'auto'")
        if self.draft_context is not None and (
            isinstance(self.draft_context, bool) or not isinstance(self.draft_context, int)
            or self.draft_context < 4 * self.max_draft_tokens):
            raise XTokSpecError(f"draft_context must be None or an integer >= 4 * max_draft_tokens "
                                f"({4 * self.max_draft_tokens}), got {self.draft_context!r}")
        for name in ("tree_width", "max_tree_nodes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise XTokSpecError(f"{name} must be an integer >= 1, got {value!r}")


def expected_tokens(alpha: float, proposals: float) -> float:
    """Tokens a cycle commits on average with per-token acceptance alpha < 1 (Leviathan et al. 2023, eq. 1)."""
    return (1 - alpha ** (proposals + 1)) / (1 - alpha)


class Laps:
    """A cycle's stage clock: `laps("draft")` adds the seconds since the last lap (or the start) to that stage."""

    __slots__ = ("clock", "start", "last", "seconds")

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock  # the loop's clock (tests hand a simulated one)
        self.start = self.last = clock()
        self.seconds = {"draft": 0.0, "bridge": 0.0, "verify": 0.0}

    def __call__(self, stage: str) -> None:
        now = self.clock()
        self.seconds[stage] += now - self.last
        self.last = now

    def elapsed(self) -> float:
        """Seconds since the start."""
        return self.clock() - self.start


ALONE = "alone"  # the kind of a cycle that ran the target alone (SpecConfig.fallback)


@dataclass(slots=True)
class CycleRecord:
    """What one cycle did and what it cost: all that the statistics and the policies learn from it."""

    kind: str  # the proposal kind it ran ("same-tokenizer", "onehot", "intersection", "greedy-bridge") or ALONE
    draft_steps: int  # draft forwards
    depth: int  # proposals in a row (a tree's depth)
    nodes: int  # target-vocabulary ids verified (a chain's are its proposals)
    accepted: int  # of the proposals in a row (a tree: nodes on the accepted path)
    rejected: bool  # the cycle stopped at a rejection (else every proposal, or a tree's whole path, was accepted)
    committed: int  # target tokens committed
    draft_s: float
    bridge_s: float  # bridging and both caches' commits (and catching the draft up after target-alone cycles)
    verify_s: float
    # a model fed its whole context (the prompt), or a step recorded or compiled a new shape: the cycle's times
    # say nothing of its steps' cost
    prefill: bool
    size: int | None = None  # a captured tree verification: the nodes its bucket carried
    predicted: float | None = None  # a tree: its verified nodes' values summed (their expected accepted count)
    pruned: int = 0  # a tree: drafted nodes left out of verification
    sampled_root: bool = False  # a tree whose root candidates were drawn from the draft
    healed: bool = False  # the first drafted id replaced the draft's last one (SpecConfig.draft_healing)
    # a sampled chain across tokenizers: the one-hot and the intersection proposal's chance of acceptance at its
    # first position, from the same draft and target distributions (what policy.ProposalChooser learns from)
    first_chances: tuple[float, float] | None = None
    alone: bool = False  # the target ran alone: nothing was drafted (SpecConfig.fallback)

    @classmethod
    def drafted(cls, *, kind: str, draft_steps: int, depth: int, nodes: int, accepted: int, rejected: bool,
                committed: int, draft_s: float, bridge_s: float, verify_s: float, prefill: bool,
                **extra) -> CycleRecord:
        """A drafted cycle's record (`extra`: the optional fields, by name)."""
        return cls(kind=kind, draft_steps=draft_steps, depth=depth, nodes=nodes, accepted=accepted,
                   rejected=rejected, committed=committed, draft_s=draft_s, bridge_s=bridge_s, verify_s=verify_s,
                   prefill=prefill, **extra)

    @classmethod
    def target_alone(cls, *, committed: int, seconds: float, prefill: bool) -> CycleRecord:
        """A target-alone cycle's record: one target step, nothing drafted, its seconds counted as verification."""
        return cls(kind=ALONE, draft_steps=0, depth=0, nodes=0, accepted=0, rejected=False, committed=committed,
                   draft_s=0.0, bridge_s=0.0, verify_s=seconds, prefill=prefill, alone=True)


@dataclass
class GenerationStats:
    """Counters and wall-clock split of one `generate` call."""

    target_forwards: int = 0  # verifier calls (one per cycle)
    draft_forwards: int = 0  # draft model calls
    drafted: int = 0  # target-vocabulary tokens proposed to the verifier
    accepted: int = 0  # of those, accepted
    rejections: int = 0  # cycles that rejected one of their proposals (the others accepted them all)
    new_tokens: int = 0  # target tokens committed
    draft_seconds: float = 0.0
    bridge_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0
    proposal: str = ""  # the proposal kind used ("same-tokenizer", "onehot", "intersection", "greedy-bridge"),
    # with " tree" appended for token trees
    stop_reason: str = ""  # see STOP_REASONS; set when generation ends
    cache: str = ""  # KV cache backends used, "target/draft" (e.g. "static/static"; "+graphs": CUDA graphs)
    # seconds this generation spent recording CUDA graphs or compiling, for shapes it met first (0 after warmup)
    capture_seconds: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)  # K chosen each cycle
    proposal_lengths: list[int] = field(default_factory=list)  # target-vocabulary proposals (tree nodes) each cycle
    accepted_lengths: list[int] = field(default_factory=list)  # of those, accepted each cycle
    pruned_nodes: int = 0  # token trees: drafted nodes left out of verification as not worth their cost
    sampled_roots: int = 0  # token trees: cycles whose root candidates were drawn from the draft (tree_root)
    healed_cycles: int = 0  # cycles whose first drafted id replaced the draft's last one (SpecConfig.draft_healing)
    alone_cycles: int = 0  # cycles that ran the target alone: drafting did not pay, as measured (SpecConfig.fallback)
    proposal_cycles: dict[str, int] = field(default_factory=dict)  # cycles per proposal kind (proposal="auto" mixes)
    # proposal="auto": each kind's expected accepted tokens per cycle, as the chooser last estimated them
    proposal_estimates: dict[str, float] = field(default_factory=dict)

    def observe(self, cycle: CycleRecord) -> None:
        """Count one cycle."""
        self.proposal_cycles[cycle.kind] = self.proposal_cycles.get(cycle.kind, 0) + 1
        self.target_forwards += 1
        self.draft_forwards += cycle.draft_steps
        self.drafted += cycle.nodes
        self.accepted += cycle.accepted
        self.rejections += cycle.rejected
        self.new_tokens += cycle.committed
        self.draft_seconds += cycle.draft_s
        self.bridge_seconds += cycle.bridge_s
        self.verify_seconds += cycle.verify_s
        self.draft_lengths.append(cycle.draft_steps)
        self.proposal_lengths.append(cycle.nodes)
        self.accepted_lengths.append(cycle.accepted)
        self.pruned_nodes += cycle.pruned
        self.sampled_roots += cycle.sampled_root
        self.healed_cycles += cycle.healed
        self.alone_cycles += cycle.alone

    @property
    def max_accepted_in_a_cycle(self) -> int:
        """The most proposals one cycle accepted: >= 2 means a cycle's second proposal was verified."""
        return max(self.accepted_lengths, default=0)

    @property
    def acceptance_rate(self) -> float:
        """Share of proposals accepted (proposals after a cycle's first rejection count as not accepted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def token_acceptance(self) -> float:
        """Per-token acceptance alpha (Leviathan et al. 2023): the chance that a proposal whose predecessors
        were accepted is accepted too. Maximum likelihood under i.i.d. acceptance: each cycle ends after its
        accepted proposals with one rejection or with all of them accepted."""
        return self.accepted / (self.accepted + self.rejections) if self.accepted + self.rejections else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "draft_lengths"}
        out.update(acceptance_rate=self.acceptance_rate, token_acceptance=self.token_acceptance,
                   tokens_per_cycle=self.tokens_per_cycle)
        return out

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.wall_seconds:.2f}s ({self.target_forwards} target calls, "
            f"{self.tokens_per_cycle:.2f} tokens/call); accepted {self.accepted}/{self.drafted} "
            f"({self.acceptance_rate:.0%}; per-token alpha {self.token_acceptance:.2f}); draft {self.draft_seconds:.2f}s, bridge {self.bridge_seconds:.3f}s, "
            f"verify {self.verify_seconds:.2f}s"
            + (f"; {self.healed_cycles} cycles healed the draft's last token" if self.healed_cycles else "")
            + (f"; {self.alone_cycles} cycles ran the target alone (fallback)" if self.alone_cycles else "")
            + (f"; {self.capture_seconds:.1f}s recording new shapes" if self.capture_seconds else "")
        )


@dataclass(frozen=True)
class GenerationResult:
    """What `XTokSpec.generate` returns."""

    text: str  # decoded continuation (target tokenizer, special tokens skipped), prompt excluded
    token_ids: list[int]  # target-tokenizer ids of the continuation, EOS included if it stopped there
    stats: GenerationStats
    stop_reason: str  # "eos", "length" or "context" (STOP_REASONS)
