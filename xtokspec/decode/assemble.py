"""The one place where a generation's or a vLLM request's drafting state is built.

`Pair` is what the two tokenizers give (their byte views, EOS ids, the maps between the vocabularies); `Kept` is
what outlives one generation (captured steps, idle static caches, the learned policies and measured costs). From
them and the options:
- `generation` builds one `loop.Run` for `XTokSpec` (its mapper, proposer, verifier's sampler and policies);
- `request_draft` builds one vLLM request's draft state and mapper for `xtokspec.vllm`.
Both choose the mapper through `mapper`, by the proposal kind (`types.ProposalKind`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runtime.cache import ModelState
from ..runtime.compile import choose_step, step_kind, warmup_plan
from ..runtime.kv import choose_backend, context_limit, input_device
from ..text.bridge import TextSync
from ..text.codec import TokenCodec
from ..types import GenerationStats, ProposalKind, SamplingParams, SpecConfig
from . import keyed, loop, sampling
from .mapping import IntersectionMap, SameVocab, Switching, TextBridge, VocabMaps
from .policy import DraftingCost, DraftLength, Fallback, ProposalChooser, TreeBudget, VerifyCost
from .propose import ChainProposer, TreeProposer
from .protocols import FallbackPolicy, MapperChoice
from .rows import RowDraftLengths
from .verify import Sampler, SamplerOps

# the kinds whose proposals are one-hot through the text bridge: the only ones that carry a healed token's
# pending text (SpecConfig.draft_healing); the intersection map never heals
log = logging.getLogger("xtokspec")

HEALING_KINDS = frozenset({ProposalKind.GREEDY_BRIDGE, ProposalKind.ONEHOT, ProposalKind.AUTO})
# the kinds whose draws may go through the intersection map: under the keyed sampler they race on the target's
# keyed noise (keyed.Coupling)
COUPLED_KINDS = frozenset({ProposalKind.INTERSECTION, ProposalKind.AUTO})


@dataclass(frozen=True)
class Pair:
    """The two tokenizers as xtokspec sees them, shared by every generation or request of one pair."""

    target: TokenCodec
    draft: TokenCodec
    target_eos: set[int]
    draft_eos: set[int]
    same_vocab: bool  # one tokenizer: the draft's ids are the target's
    maps: VocabMaps  # the maps between the vocabularies, each built on first use

    @classmethod
    def of(cls, target: TokenCodec, draft: TokenCodec, target_eos: set[int], draft_eos: set[int]) -> Pair:
        same = target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
        return cls(target, draft, target_eos, draft_eos, same, VocabMaps(target, draft, target_eos, draft_eos))

    def head(self, draft_prompt: list[int]) -> int:
        """The leading draft ids a window of the text keeps: the BOS, where the draft's prompt starts with it."""
        bos = self.draft.tokenizer.bos_token_id
        return int(bos is not None and draft_prompt[:1] == [bos])


class Kept:
    """What outlives one generation: each model's captured step, idle static caches, the policies' learned state
    per setting."""

    def __init__(self):
        self.steps: dict[int, object] = {}  # id(model) -> its step (SpecConfig.compile), or None: eager
        self.idle_kv: dict[int, list] = {}  # id(model) -> static caches no generation holds, the largest first
        self.tree_size_times: dict = {}  # captured tree verification costs per size (policy.TreeBudget)
        self.alone_times = collections.deque(maxlen=Fallback.ALONE_SAMPLES)  # target-alone cycle seconds
        # what drafting costs and how often it is accepted, per setting (config, sampling, kind): the fallback's
        # DraftingCost and the DraftLength policy carry over between generations (the costs are the models' and
        # the device's, the acceptance the pair's on similar text), so a later generation starts from them
        self.learned: dict[tuple, tuple[DraftingCost, DraftLength]] = {}
        self.serving: dict[tuple, RowDraftLengths] = {}  # per (cap, adaptive): a vLLM proposer's draft lengths

    def step(self, model, compile, cache: str, role: str):
        """`model`'s step (compile.choose_step: CUDA graphs, torch.compile, or None for eager), chosen once (a
        model that cannot be captured is named in a warning then)."""
        if id(model) not in self.steps:
            self.steps[id(model)] = choose_step(model, compile, cache, role)
        return self.steps[id(model)]

    def state(self, model, ids: list[int], backend: str, capacity: int, step=None, tree_nodes: int = 0) -> ModelState:
        """ids + a KV cache; a static one reuses an idle cache of the model's where there is one."""
        # NOTE: taken, not shared: a generation still running (another open stream) keeps its own cache
        idle = self.idle_kv.get(id(model))
        reuse = idle.pop(0) if backend == "static" and idle else None
        return ModelState(model, ids, backend, capacity, step, tree_nodes, reuse)

    def release(self, state: ModelState, keep: int = 1) -> None:
        """A finished generation's (or request's) static cache, kept for the next: at most `keep` per model, the
        largest."""
        if state.backend != "static":
            return
        idle = self.idle_kv.setdefault(id(state.model), [])
        idle.append(state.kv)
        idle.sort(key=lambda kv: -kv.capacity)  # NOTE: stable: of two the same size, the one kept longer stays
        del idle[keep:]

    def forget(self, model) -> None:
        """Drop what is kept for a model that is gone (its id may be reused by another)."""
        self.steps.pop(id(model), None)
        self.idle_kv.pop(id(model), None)

    def policies(self, config: SpecConfig, params: SamplingParams, kind: ProposalKind) -> tuple[DraftingCost, DraftLength]:
        """The drafting costs and draft-length policy learned so far for this setting."""
        setting = (config, dataclasses.replace(params, seed=None), kind)
        if setting not in self.learned:
            self.learned[setting] = DraftingCost(alone_run=Fallback.PROBE_DRAFT_FIRST), DraftLength(config, VerifyCost())
        return self.learned[setting]

    def row_lengths(self, cap: int, adaptive: bool = True) -> RowDraftLengths:
        """The draft-length policy of requests served together (a vLLM proposer's), with what it has learned."""
        return self.serving.setdefault((cap, adaptive), RowDraftLengths(cap, adaptive))

    @property
    def capture_seconds(self) -> float:
        """Seconds spent recording CUDA graphs or compiling steps, over all generations."""
        return sum(step.setup_seconds for step in self.steps.values() if step is not None)


# ---------------------------------------------------------------------------------------------- mappers
def mapper(pair: Pair, kind: ProposalKind, *, draft_prompt: list[int], lookbehind: int, healing: bool,
           logits_device: torch.device, draft_device: torch.device, target_vocab: int,
           min_mapped_mass: float = 0.5, estimates: dict | None = None) -> MapperChoice:
    """The mapper for a proposal kind: `healing` where the kind allows it (HEALING_KINDS); `estimates`: the dict
    that proposal="auto"'s chooser keeps its scores in (GenerationStats.proposal_estimates)."""
    head = pair.head(draft_prompt)
    if kind is ProposalKind.SAME_TOKENIZER:
        return SameVocab(target_vocab, logits_device, head)
    sync = TextSync(pair.target, pair.draft, lookbehind)
    bridge_kind = ProposalKind.GREEDY_BRIDGE if kind is ProposalKind.GREEDY_BRIDGE else ProposalKind.ONEHOT
    bridge = TextBridge(sync, pair.target_eos, len(draft_prompt), bridge_kind.value, head, pair.maps.draft_index,
                        healing and kind in HEALING_KINDS)
    if bridge_kind is kind:
        return bridge
    intersection = IntersectionMap(bridge, pair.maps.draft_to_target(draft_device), target_vocab, logits_device)
    if kind is ProposalKind.INTERSECTION:
        return intersection
    # AUTO: one-hot or intersection, chosen each cycle; the chooser scores on the target's logits device
    maps = pair.maps
    start = ProposalKind.INTERSECTION if maps.token_map.mapped_draft_share >= min_mapped_mass else ProposalKind.ONEHOT
    return Switching(bridge, intersection, ProposalChooser(start.value, estimates=estimates),
                     maps.first_pieces.to(logits_device), maps.draft_to_target(logits_device))


# ---------------------------------------------------------------------------------------------- a generation
def states(kept: Kept, target_model, draft_model, target_ids: list[int], draft_ids: list[int], max_new_tokens: int,
           config: SpecConfig) -> tuple[ModelState, ModelState]:
    """Both models' ids and caches for a generation of `max_new_tokens`, sized as the loop needs them: the
    draft's text in its own tokens is unknown in advance, so at most 3 per target token is budgeted."""
    trees = config.tree_width > 1

    def one(model, ids, role, capacity, tree_nodes):
        step = kept.step(model, config.compile, config.cache, role)
        return kept.state(model, ids, choose_backend(model, config.cache, step is not None), capacity, step, tree_nodes)

    target = one(target_model, target_ids, "target", len(target_ids) + max_new_tokens,
                 config.max_tree_nodes if trees else 0)
    # the draft's beam: at most tree_width nodes per level, one level per draft step (grow_tree)
    draft = one(draft_model, draft_ids, "draft", len(draft_ids) + 3 * max_new_tokens + 2 * config.max_draft_tokens + 16,
                config.tree_width * config.max_draft_tokens if trees else 0)
    return target, draft


def generation(pair: Pair, kept: Kept, target: ModelState, draft: ModelState, stats: GenerationStats,
               params: SamplingParams, config: SpecConfig, kind: ProposalKind, *,
               fallback_policy: Callable[[SpecConfig], FallbackPolicy] | None = None,
               sampler_ops: SamplerOps | None = None, clock: Callable[[], float] = time.perf_counter) -> loop.Run:
    """One generation's loop state over both models' states: its mapper, proposer, sampler and policies.
    `fallback_policy`: config -> the policy that chooses target-alone cycles (None: the measured
    `policy.Fallback`); `sampler_ops`: the verifier's sampling steps (None: the proven ones); `clock`: what the
    loop's timings, and so the policies, read."""
    target_model, draft_model = target.model, draft.model
    kinds = {step_kind(target.step), step_kind(draft.step)}
    stats.cache = (f"{target.backend}/{draft.backend}" + ("+graphs" if "graphs" in kinds else "")
                   + ("+compile" if "inductor" in kinds else ""))
    warpers = sampling.build_warpers(params) if params.do_sample else None
    sampler = draft_gen = None
    if params.do_sample:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        sampler = Sampler(warpers, torch.Generator(device=input_device(target_model)).manual_seed(seed),
                          sampler_ops or SamplerOps(), key=seed if params.keyed else None, start=len(target.ids))
        draft_gen = torch.Generator(device=input_device(draft_model)).manual_seed(seed + 1)
    drafting, draft_length = kept.policies(config, params, kind)
    fallback = (fallback_policy(config) if fallback_policy is not None
                else Fallback(config, kept.alone_times, drafting))
    budget = TreeBudget(config, draft_length.verify_cost, kept.tree_size_times)
    target_vocab = target_model.config.vocab_size
    draft_device = input_device(draft_model)
    coupling = None  # the keyed sampler's coupled draws (chains on the intersection map, and sampled tree roots)
    keyed_sampler = sampler is not None and sampler.key is not None
    if config.tree_width > 1:
        groups = params.do_sample and config.tree_root == "sampled"
        roots = (pair.maps.root_groups(pair.same_vocab, target_vocab, draft_model.config.vocab_size).to(draft_device)
                 if groups else None)
        proposer = TreeProposer(config.tree_width, pair.draft_eos, pair.draft.token_bytes, budget, target,
                                target.max_tree_nodes(config.max_tree_nodes), warpers, draft_gen, roots, target_vocab)
        if keyed_sampler and roots is not None:
            proposer.coupling = keyed.Coupling(sampler.key, target, sampler.start)
    else:
        proposer = ChainProposer(pair.draft_eos, warpers, draft_gen, config.draft_confidence, pair.draft.token_bytes)
        if keyed_sampler and kind in COUPLED_KINDS:
            coupling = keyed.Coupling(sampler.key, target, sampler.start, pair.maps.draft_to_target(draft_device))
            proposer.coupling = coupling
    mapping = mapper(pair, kind, draft_prompt=draft.ids, lookbehind=config.draft_lookbehind,
                     healing=config.draft_healing and config.tree_width == 1,  # trees: a cache level per step
                     logits_device=target_model.get_output_embeddings().weight.device, draft_device=draft_device,
                     target_vocab=target_vocab, min_mapped_mass=config.min_mapped_mass,
                     estimates=stats.proposal_estimates)
    policies = (stats, draft_length, budget, fallback) if config.tree_width > 1 else (stats, draft_length, fallback)
    if isinstance(mapping, Switching):  # the chooser observes the verified cycles first, as the commit once did
        policies = (mapping.chooser, *policies)
        mapping.coupled = coupling is not None
    return loop.Run(
        target=target, draft=draft, mapper=mapping, proposer=proposer, sampler=sampler, draft_length=draft_length,
        fallback=fallback, observers=policies, stats=stats, target_eos=pair.target_eos,
        target_limit=min(context_limit(target_model) or 1 << 30, target.capacity),
        draft_limit=min(context_limit(draft_model) or 1 << 30, draft.capacity, config.draft_context or 1 << 30),
        draft_room=config.max_draft_tokens + 1, clock=clock,
    )


# ---------------------------------------------------------------------------------------------- a vLLM request
def request_draft(pair: Pair, kept: Kept, draft_model, prompt: list[int], tail: list[int], *, backend: str,
                  capacity: int, step=None, lookbehind: int, healing: bool,
                  target_vocab: int) -> tuple[ModelState, MapperChoice]:
    """One vLLM request's draft: its ids and cache over the draft's `prompt` ids, and the greedy mapper that
    keeps it on the committed text (`tail`: the target ids after the last whole character, whose bytes wait in
    the text state)."""
    state = kept.state(draft_model, prompt, backend, capacity, step)
    kind = ProposalKind.SAME_TOKENIZER if pair.same_vocab else ProposalKind.GREEDY_BRIDGE
    device = input_device(draft_model)
    mapping = mapper(pair, kind, draft_prompt=prompt, lookbehind=lookbehind, healing=healing, logits_device=device,
                     draft_device=device, target_vocab=target_vocab)
    if tail:
        mapping.commit(state, [], tail)
    return state, mapping


# ---------------------------------------------------------------------------------------------- warm-up
def warm_up(kept: Kept, target_model, draft_model, target_ids: list[int], draft_ids: list[int], max_new_tokens: int,
            config: SpecConfig, progress: bool = True) -> int:
    """Record or compile every shape that generations of this size can meet (`compile.warmup_plan`) -> the number
    of shapes; 0 where both models run eagerly."""
    steps = [kept.step(model, config.compile, config.cache, role)
             for model, role in ((target_model, "target"), (draft_model, "draft"))]
    if not any(steps):
        return 0
    from tqdm.auto import tqdm

    target, draft = states(kept, target_model, draft_model, target_ids, draft_ids, max_new_tokens, config)
    plan = warmup_plan(target, draft, config)
    before = kept.capture_seconds
    kinds = sorted({step_kind(step) for step in steps} - {None})
    try:
        with torch.inference_mode():
            for state in (target, draft):
                state.forward(keep=1)  # the prompt (eager: a cache's first forward always is)
            desc = "recording CUDA graphs" if kinds == ["graphs"] else "compiling"
            for state, call, n in tqdm(plan, desc=desc, disable=not progress):
                prompt_len = len(state.ids)
                for _ in range(2):  # torch.compile's CUDA graphs are recorded on a shape's second call
                    call(state, n)
                    state.truncate(prompt_len)
    finally:
        kept.release(target)
        kept.release(draft)
    log.info("warmup: %d shapes (%s) ready in %.1f s", len(plan), " and ".join(kinds), kept.capture_seconds - before)
    return len(plan)
