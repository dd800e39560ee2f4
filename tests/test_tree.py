"""Token trees: the tree-masked forward and its cache compaction, the verifier against reference/tree.py on the
same noise, and greedy losslessness for every tree width (the chi-square tests are in test_stats.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mutants import unnormalised_walk
from test_greedy import HOSTILE_PROMPTS, NEW_TOKENS, check_prompts

import reference.tree as ref
import xtokspec.decode.tree
from xtokspec import SpecConfig, XTokSpec, XTokSpecError
from xtokspec.decode.tree import Trie, verify_tree_greedy, verify_tree_sampled
from xtokspec.runtime.cache import ModelState
from xtokspec.runtime.compile import move_positions


def ancestors(trie: Trie, node: int) -> list[int]:
    """node's path from the root's first child down to node itself (empty for the root)."""
    out = []
    while node > 0:
        out.append(node)
        node = trie.parents[node]
    return out[::-1]


def make_trie(paths) -> Trie:
    trie = Trie()
    for path in paths:
        trie.insert(path)
    return trie


def test_trie_merges_shared_prefixes_and_caps_depth_and_nodes():
    trie = make_trie([[5, 6, 7], [5, 8], [9], [5, 6, 7]])
    assert trie.tokens == [-1, 5, 6, 7, 8, 9]
    assert trie.parents == [-1, 0, 1, 2, 1, 0]
    assert trie.children[1] == [2, 4] and trie.depth == 3
    capped = Trie()
    capped.insert([1, 2, 3, 4], max_depth=2)
    capped.insert([7, 8, 9], max_nodes=3)
    assert capped.tokens == [-1, 1, 2, 7]


def test_trie_values_take_the_likeliest_path_and_never_increase_downwards():
    trie = Trie()
    trie.insert([5, 6, 7], values=[0.6, 0.3, 0.1])
    trie.insert([5, 8], values=[0.2, 0.15])  # 5 keeps 0.6 (the larger)
    trie.insert([9], values=[0.3])
    trie.insert([5, 6, 7], values=[0.5, 0.4, 0.35])  # raises 6 and 7 (not 5)
    assert trie.values == [1.0, 0.6, 0.4, 0.35, 0.15, 0.3]
    trie.insert([9, 4], values=[0.1, 0.9])  # a value above its parent's is cut to it
    assert trie.values[-1] == 0.3
    assert trie.ranked() == [1, 2, 3, 5, 6, 4]  # by value; the tie 0.3 / 0.3 goes to the parent's number first


def test_pruned_trie_keeps_the_most_valuable_nodes_with_their_parents():
    rng = np.random.default_rng(11)
    for _ in range(200):
        tokens, parents = ref.random_trie(rng, vocab_size=5, nodes=int(rng.integers(1, 25)))
        trie = Trie()
        for n in range(1, len(tokens)):  # insert each node's path with random values that never increase
            path = []
            a = n
            while a > 0:
                path.append(a)
                a = parents[a]
            path.reverse()
            vals = np.minimum.accumulate(rng.choice([0.1, 0.2, 0.5, 0.9], size=len(path)))  # ties on purpose
            trie.insert([tokens[a] for a in path], values=vals.tolist())
        keep = int(rng.integers(1, trie.size + 1))
        small = trie.pruned(keep)
        assert small.size == keep
        expected = sorted(trie.values[1:], reverse=True)[:keep]
        assert sorted(small.values[1:], reverse=True) == expected
        kept_paths = {tuple(small.path_tokens(ancestors(small, n))) for n in range(1, small.size + 1)}
        all_paths = {tuple(trie.path_tokens(ancestors(trie, n))): n for n in range(1, trie.size + 1)}
        for path in kept_paths:  # every kept node is a node of the trie, with its value, and its parent is kept
            assert path in all_paths and (len(path) == 1 or path[:-1] in kept_paths)
        for n in range(1, small.size + 1):
            assert small.parents[n] < n and small.depths[n] == small.depths[small.parents[n]] + 1
            assert small.values[n] == trie.values[all_paths[tuple(small.path_tokens(ancestors(small, n)))]]
        for kids in small.children:  # siblings in their original order
            original = [all_paths[tuple(small.path_tokens(ancestors(small, c)))] for c in kids]
            assert original == sorted(original)
    assert trie.pruned(trie.size) is trie


def test_the_tree_budget_maximises_expected_tokens_per_second():
    """The policy verifies the n most valuable nodes that maximise (1 + r * sum of values) / (spent + verify(n)),
    with verify(n) its fitted cost line and r the measured ratio of accepted to predicted nodes."""
    from policies import drafted

    from xtokspec.decode.policy import TreeBudget, VerifyCost

    cost = VerifyCost()
    budget = TreeBudget(SpecConfig(tree_width=4), cost)
    values = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02]
    assert budget.nodes(values, 0.01) == len(values)  # nothing measured yet: all
    for n in (2, 4, 8, 16, 6):  # verification costs 10 ms + 2 ms per node
        cost.observe(n, 0.010 + 0.002 * n)
        budget.observe(drafted(2, 2, 1, 0.002, 0.010 + 0.002 * n, nodes=n, rejected=True))
    for _ in range(40):
        budget.observe(drafted(2, 2, 1, 0.002, 0.01, predicted=2.0))  # accepted half the predicted nodes

    def brute(r, spent):
        rates = [(1 + r * sum(values[:n])) / (spent + 0.010 + 0.002 * n) for n in range(1, len(values) + 1)]
        return 1 + int(np.argmax(rates))

    r = budget.realised / budget.predicted
    assert abs(r - 0.5) < 0.02
    assert budget.nodes(values, 0.004) == brute(r, 0.004)
    assert 1 < budget.nodes(values, 0.004) < len(values)
    assert budget.nodes(values, 1.0) == len(values)  # a slow draft: every node is worth its 2 ms
    for config in (SpecConfig(tree_width=4, adaptive=False), SpecConfig(tree_width=4, prune_tree=False)):
        unpruned = TreeBudget(config, cost)
        unpruned.cycles = budget.cycles
        assert unpruned.nodes(values, 0.004) == len(values)


def test_a_captured_tree_is_costed_per_bucket():
    """Through a compiled target a trie is verified padded to a bucket: the budget compares the sizes the buckets
    carry (room), each at the fastest of its recent times; sizes seen fewer than twice are tried first (largest
    first), and a first call that compiled does not make its size look slow for good."""
    from policies import drafted

    from xtokspec.decode.policy import TreeBudget, VerifyCost
    from xtokspec.runtime.compile import padded_length

    room = lambda n: padded_length(1 + n) - 1  # noqa: E731  (one uncached id before the nodes, as every cycle)
    cost = {1: 0.0110, 3: 0.0112, 7: 0.0120, 15: 0.0135, 31: 0.0170}  # the H100's shape: a step per bucket
    values = [0.9, 0.6, 0.4, 0.3, 0.2, 0.15, 0.1] + [0.02] * 24  # 31 drafted nodes, the later ones worth little
    times = {}
    policy = TreeBudget(SpecConfig(tree_width=4), VerifyCost(), size_times=times)
    for _ in range(3):  # nothing measured yet (the first cycles verify every node)
        assert policy.nodes(values, 0.004, room) == len(values)
        policy.observe(drafted(4, 4, 1, 0.004, 2.0 if not times else cost[31], nodes=31, rejected=True, size=31))
    explored = []
    for _ in range(12):
        size = policy.nodes(values, 0.004, room)
        assert size == room(size)  # a whole bucket's worth of nodes, never a part of one
        explored.append(size)
        policy.observe(drafted(4, 4, 1, 0.004, cost[size], nodes=size, rejected=True, size=size))
    assert explored[:8] == [15, 15, 7, 7, 3, 3, 1, 1]  # each smaller size twice, the largest first

    def best(r):
        rates = {n: (1 + r * sum(values[:n])) / (0.004 + c) for n, c in cost.items()}
        return max(rates, key=rates.get)

    r = policy.realised / policy.predicted
    assert explored[8:] == [best(r)] * 4 and best(r) == 7  # the tokens the last 24 nodes add are not worth 5 ms
    # a verification as cheap at 32 rows as at 2: every node is worth taking, though the largest size's first
    # call took 2 s (compiling)
    cheap = {n: [0.0110, 0.0110] for n in cost} | {31: [2.0, 0.0110]}
    fresh = TreeBudget(SpecConfig(tree_width=4), VerifyCost(), size_times=cheap)
    fresh.cycles = 3
    assert fresh.nodes(values, 0.004, room) == 31
    assert fresh.nodes(values[:5], 0.004, room) == 5  # the bucket holds 7; the trie has 5
    # a second generation of the same XTokSpec starts from the sizes already measured
    again = TreeBudget(SpecConfig(tree_width=4), VerifyCost(), size_times=times)
    again.cycles, again.predicted, again.realised = 3, policy.predicted, policy.realised
    assert again.nodes(values, 0.004, room) == 7


def test_the_verification_cost_line_ignores_the_prompt_and_noise_from_equal_counts():
    """The first cycle's verification also carries the prompt: it is left out of the cost line. Counts that
    barely vary give no slope (a steep line from them would be noise), and the slope never exceeds the line
    through the origin."""
    from policies import drafted

    from xtokspec.decode.policy import DraftLength

    policy = DraftLength(SpecConfig(tree_width=4))
    cost = policy.verify_cost
    policy.observe(drafted(2, 2, 1, 0.002, None, nodes=4, rejected=True))  # the prefill cycle: not recorded
    assert cost.sums[0] == 0 and cost(4) == 0.0
    for t in (0.010, 0.012, 0.011):  # 4 nodes every time
        policy.observe(drafted(2, 2, 1, 0.002, t, nodes=4, rejected=True))
    assert abs(cost(4) - cost(40)) < 1e-12  # no slope
    for n, t in ((1, 0.001), (8, 0.100), (2, 0.001), (9, 0.120)):  # a steep line with a negative intercept
        policy.observe(drafted(2, 2, 1, 0.002, t, nodes=n, rejected=True))
    assert cost(0) >= -1e-12  # clamped to the line through the origin


@pytest.mark.parametrize("node_cost", [0.0, 1.0], ids=["free-nodes", "costly-nodes"])
def test_pruned_trees_stay_lossless(node_cost, ja_target, ja_draft_bpe, heldout_prompts, monkeypatch):
    """Whatever the budget keeps, greedy output is the target's own: nodes that cost nothing are all
    verified; nodes that cost a second each are cut to one per cycle."""
    from xtokspec.decode.policy import VerifyCost

    monkeypatch.setattr(VerifyCost, "__call__", lambda self, m: 0.01 + node_cost * m)
    spec = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(tree_width=4))
    for line in check_prompts(spec, ja_target, heldout_prompts[:4], 24, {}):
        print("near-tie:", line)
    stats = spec.generate(heldout_prompts[0], max_new_tokens=24).stats
    if node_cost:
        assert stats.pruned_nodes > 0 and set(stats.proposal_lengths[3:]) == {1}
    else:
        assert stats.pruned_nodes == 0 and max(stats.proposal_lengths) > 1


ARCHS = ["llama", "gpt2", "gpt_neox"]  # the fixture target; llm-jp-13b's class (learned positions); open-calm's


def tree_model(arch: str, ja_target):
    """The fixture target, or a tiny random model of the mission pair's classes (same vocabulary size)."""
    if arch == "llama":
        return ja_target[0]
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=8000, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=0)).eval()
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=8000, max_position_embeddings=64, hidden_size=32,
                                            num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)).eval()


def tree_state(model, prompt: list[int], backend: str, calls: list[int] | None = None,
               positions: list[int] | None = None) -> ModelState:
    """A ModelState on `backend`; "static+step": the static cache of a compiled model, with an uncompiled step
    that records each call's length and largest position id (padded buckets over the whole buffer, as a
    captured graph runs)."""
    if backend != "static+step":
        return ModelState(model, prompt, backend, 40, tree_nodes=16)
    positions = [] if positions is None else positions

    def step(**kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        if kwargs.get("position_ids") is not None:
            positions.append(int(kwargs["position_ids"].max()))
        return model(**kwargs)

    def move(tensors, index_from, index_to):  # keep_path's captured move (CompiledStep.move_positions)
        calls.append(("move", index_from.shape[0]))
        move_positions(tensors, index_from, index_to)

    step.move_positions = move
    return ModelState(model, prompt, "static", 40, step, tree_nodes=16)


@pytest.mark.parametrize("backend", ["dynamic", "static", "static+step"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_scores_every_path_and_keeps_only_the_accepted_one(arch, backend, ja_target):
    """Row n of the tree forward equals a plain forward over the path to node n; after keep_path the cache
    holds exactly the committed ids (the next forward equals a plain forward over them). With a compiled step
    the forward is padded to a bucket (2 ids + 12 nodes -> 16) and its padding rolled back."""
    model = tree_model(arch, ja_target)
    prompt = torch.randint(10, 7000, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    trie = make_trie([[5, 6, 7], [5, 8], [9, 10, 11, 12], [5, 6, 13]])
    calls, positions = [], []
    with torch.inference_mode():
        state = tree_state(model, prompt, backend, calls, positions)
        state.forward(keep=1)
        state.ids += [42, 43]  # two uncached ids before the tree
        logits = state.forward_tree(trie.tokens, trie.parents)
        assert logits.shape[0] == trie.size + 1
        for node in range(trie.size + 1):
            path = trie.path_tokens(ancestors(trie, node))
            want = model(input_ids=torch.tensor([prompt + [42, 43] + path])).logits[0, -1]
            torch.testing.assert_close(logits[node], want, atol=1e-4, rtol=0)
        path = ancestors(trie, trie.tokens.index(11))  # nodes 9 -> 10 -> 11: not the first nodes
        state.keep_path(path, trie.tokens)
        assert state.ids[-3:] == [9, 10, 11] and state.cached == len(state.ids)
        state.ids.append(99)
        got = state.forward(keep=1)[0]
        torch.testing.assert_close(got, model(input_ids=torch.tensor([state.ids])).logits[0, -1], atol=1e-4, rtol=0)
    assert calls == ([16, ("move", 4), 1] if backend == "static+step" else [])  # 3 positions moved, padded to 4
    # the padding's positions stay within the real rows' (22 ids; node depths up to 4): a learned position table
    # (GPT-2's) has no row past the context's end
    assert positions == ([21 + 4] if backend == "static+step" else [])


@pytest.mark.parametrize("backend", ["dynamic", "static", "static+step"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_grown_level_by_level_scores_every_path_and_truncates_away(arch, backend, ja_target):
    """grow_tree (the draft's beam, one forward per level on its own cache): row i of each level equals a plain
    forward over the path to that node; truncate drops every node (the next forward equals a plain one)."""
    model = tree_model(arch, ja_target)
    prompt = torch.randint(10, 7000, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    levels = [([5, 9], [0, 0]), ([6, 8, 10], [1, 1, 2]), ([7, 7], [3, 4])]  # nodes 1-2, 3-5, 6-7
    paths = {0: []}
    calls = []
    with torch.inference_mode():
        state = tree_state(model, prompt, backend, calls)
        state.forward(keep=1)
        for tokens, parents in levels:
            logits = state.grow_tree(tokens, parents)
            assert logits.shape[0] == len(tokens)
            for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
                node = state.tree_size - len(tokens) + 1 + i
                paths[node] = paths[parent] + [token]
                want = model(input_ids=torch.tensor([prompt + paths[node]])).logits[0, -1]
                torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=0)
        assert state.tree_size == 7 and state.cached == len(prompt) + 7
        for tokens, parents in [([1], [9]), ([1, 2], [0]), ([], [])]:
            with pytest.raises(ValueError, match="one parent each"):
                state.grow_tree(tokens, parents)
        assert state.tree_size == 7  # nothing changed
        state.truncate(len(prompt))
        assert state.tree_size == 0 and state.cached == len(prompt)
        state.ids.append(99)
        got = state.forward(keep=1)[0]
        torch.testing.assert_close(got, model(input_ids=torch.tensor([state.ids])).logits[0, -1], atol=1e-4, rtol=0)
    assert calls == ([2, 4, 2, 1] if backend == "static+step" else [])


def random_case(seed: int, vocab: int = 6, nodes: int = 7):
    rng = np.random.default_rng(seed)
    tokens, parents = ref.random_trie(rng, vocab, nodes)
    probs = rng.dirichlet(np.full(vocab, 0.4), size=nodes + 1)
    uniforms = rng.random((nodes + 1, vocab))
    noise = rng.exponential(size=vocab)
    return tokens, parents, probs, uniforms, noise


@pytest.mark.parametrize("renormalize", [True, False])
def test_torch_tree_verifier_equals_the_reference_on_the_same_noise(renormalize, monkeypatch):
    """xtokspec.decode.tree and reference.tree make the same decisions from the same draws (2,000 random tries); and so
    do their negative controls (the walk without renormalisation: tests/mutants.py, reference's flag)."""
    if not renormalize:
        monkeypatch.setattr(xtokspec.decode.tree, "walk_sampled", unnormalised_walk())
    agree_paths = 0
    for seed in range(2000):
        tokens, parents, probs, uniforms, noise = random_case(seed)
        trie = Trie()
        for node in range(1, len(tokens)):
            trie.tokens.append(tokens[node])
            trie.parents.append(parents[node])
            trie.depths.append(trie.depths[parents[node]] + 1)
            trie.children.append([])
            trie.children[parents[node]].append(node)
        width = trie.max_children()
        got = verify_tree_sampled(torch.tensor(probs, dtype=torch.float32), trie,
                                  torch.tensor(uniforms[:, :width], dtype=torch.float32),
                                  torch.tensor(noise, dtype=torch.float32))
        want = ref.tree_walk(tokens, parents, probs.astype(np.float32).astype(np.float64),
                             uniforms[:, :width].astype(np.float32).astype(np.float64),
                             noise.astype(np.float32).astype(np.float64), renormalize=renormalize)
        assert got == want, (seed, got, want)
        agree_paths += len(got[0]) > 0
    assert agree_paths > 500  # the walk really descends in many cases


@pytest.mark.parametrize("flat", [False, True])
def test_torch_sampled_root_equals_the_reference_on_the_same_noise(flat):
    """A sampled root (children drawn from q, tested against it; one-hot below): xtokspec.decode.tree and
    reference.tree make the same decisions from the same draws (2,000 random tries; `flat`: near-uniform p and q,
    where later children are often reached)."""
    agree_paths = stopped_at_root = 0
    for seed in range(2000):
        tokens, parents, probs, uniforms, noise = random_case(seed)
        rng = np.random.default_rng(seed + 10_000)
        root_q = rng.dirichlet(np.full(probs.shape[-1], 5.0 if flat else 0.4))
        if flat:
            probs = rng.dirichlet(np.full(probs.shape[-1], 5.0), size=len(probs))
        root_children = [tokens[n] for n in range(1, len(tokens)) if parents[n] == 0]
        root_q[root_children] = np.maximum(root_q[root_children], 1e-3)  # a drawn child has q > 0
        root_q /= root_q.sum()
        trie = Trie()
        for node in range(1, len(tokens)):
            trie.tokens.append(tokens[node])
            trie.parents.append(parents[node])
            trie.depths.append(trie.depths[parents[node]] + 1)
            trie.children.append([])
            trie.children[parents[node]].append(node)
        width = trie.max_children()
        as_f32 = lambda a: np.asarray(a, dtype=np.float32).astype(np.float64)  # noqa: E731
        got = verify_tree_sampled(torch.tensor(probs, dtype=torch.float32), trie,
                                  torch.tensor(uniforms[:, :width], dtype=torch.float32),
                                  torch.tensor(noise, dtype=torch.float32),
                                  root_q=torch.tensor(root_q, dtype=torch.float32))
        want = ref.sampled_root_tree_walk(tokens, parents, as_f32(probs), as_f32(root_q), as_f32(uniforms[:, :width]),
                                          as_f32(noise))
        assert got == want, (seed, got, want)
        agree_paths += len(got[0]) > 0
        stopped_at_root += not got[0]
    assert agree_paths > 500 and stopped_at_root > 100  # both outcomes are common


def test_a_pinned_root_child_is_verified_whatever_its_value():
    """A sampled root's draws rank before every other node and survive any pruning (dropping a draw for its own
    value would bias the rule), and keep their draw order as the root's children."""
    trie = Trie()
    trie.insert([7], values=[0.01])
    trie.insert([3], values=[0.02])
    trie.pinned = 2
    trie.insert([9, 4], values=[0.9, 0.8])  # a valuable node under a later, unpinned child
    trie.insert([3, 5], values=[0.5, 0.5])  # capped at its parent's 0.02
    assert set(trie.ranked()[:2]) == {1, 2}
    kept = trie.pruned(1)
    assert [kept.tokens[c] for c in kept.children[0]] == [7, 3] and kept.pinned == 2 and kept.size == 2
    kept = trie.pruned(3)
    assert [kept.tokens[c] for c in kept.children[0]] == [7, 3, 9] and kept.size == 3


def test_greedy_tree_follows_the_argmax_path():
    trie = make_trie([[1, 2], [1, 3, 0], [2]])  # nodes: 1:(1) 2:(2 under 1) 3:(3 under 1) 4:(0 under 3) 5:(2)
    logits = torch.full((trie.size + 1, 4), -1.0)
    for node, best in {0: 1, 1: 3, 3: 0, 4: 2}.items():
        logits[node, best] = 1.0
    assert verify_tree_greedy(logits, trie) == ([1, 3, 4], 2)
    logits[0] = torch.tensor([0.0, 0.0, 0.0, 5.0])  # root argmax 3: no child
    assert verify_tree_greedy(logits, trie) == ([], 3)


@pytest.mark.slow
@pytest.mark.parametrize("draft, width, backend", [("bridged", 2, "dynamic"), ("bridged", 4, "dynamic"),
                                                   ("bridged", 8, "static"), ("same", 4, "dynamic"),
                                                   ("same", 3, "static"), ("bridged", 4, "rows")])
def test_greedy_tree_equals_target(draft, width, backend, ja_target, ja_draft_bpe, ja_draft_same,
                                   heldout_prompts, reference_cache, monkeypatch):
    """Greedy token trees are lossless: the target's own generate, token for token (or a reported near-tie).
    "rows": the draft's beam as batch rows over a copy of its cache, the path of drafts with sliding-window
    layers (Gemma-3), forced here on the fixture draft."""
    import xtokspec.runtime.cache

    rows = backend == "rows"
    if rows:
        monkeypatch.setattr(xtokspec.runtime.cache, "sliding_layers", lambda model: ["sliding_attention"])
        backend = "dynamic"
    copies = []
    branches = ModelState.branches
    monkeypatch.setattr(ModelState, "branches", lambda state, n: copies.append(n) or branches(state, n))
    spec = XTokSpec(ja_target, ja_draft_bpe if draft == "bridged" else ja_draft_same,
                    config=SpecConfig(tree_width=width, cache=backend))
    result = spec.generate(heldout_prompts[0], max_new_tokens=16)
    assert result.stats.proposal.endswith(" tree") and result.stats.cache.startswith(backend)
    assert max(result.stats.proposal_lengths) > 1  # the tree carried several nodes
    assert bool(copies) == rows  # the beam grew on the draft's own cache, or (rows) in copied batch rows
    for line in check_prompts(spec, ja_target, heldout_prompts[:10] + HOSTILE_PROMPTS, NEW_TOKENS, reference_cache):
        print("near-tie:", line)


@pytest.mark.slow
def test_tree_keeps_going_to_the_end_of_the_context(ja_target, ja_draft_bpe):
    """Near max_position_embeddings the tree is cut to fit, and generation stops for the context as the
    target alone would."""
    spec = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(tree_width=4))
    limit = ja_target[0].config.max_position_embeddings
    prompt = "あ" * (limit - 8)
    result = spec.generate(prompt, max_new_tokens=64)
    assert len(spec.target.encode_prompt(prompt)) + len(result.token_ids) <= limit
    assert result.stop_reason in ("context", "eos")


def test_tree_settings_are_checked(bridged_spec):
    with pytest.raises(XTokSpecError, match="tree_width must be an integer >= 1"):
        SpecConfig(tree_width=0)
    with pytest.raises(XTokSpecError, match="max_tree_nodes"):
        SpecConfig(max_tree_nodes=True)
    with pytest.raises(XTokSpecError, match="prune_tree must be True or False"):
        SpecConfig(prune_tree=1)
    with pytest.raises(XTokSpecError, match="proposal='intersection' needs tree_width=1"):
        bridged_spec.generate("こんにちは", max_new_tokens=4, do_sample=True, proposal="intersection", tree_width=4)
    result = bridged_spec.generate("こんにちは", max_new_tokens=4, do_sample=True, tree_width=4, seed=0)
    assert result.stats.proposal == "onehot tree"


def test_tree_cost_benchmark_builds_tries_of_the_asked_size_and_fits_a_line():
    from model_helpers import load_script

    tree_cost = load_script("benchmarks/tree_cost.py")
    for n in tree_cost.NODES:
        shapes = tree_cost.tries(n)
        assert {shape: t.size for shape, t in shapes.items()} == {"flat": n, "beam": n}
    base, slope = tree_cost.fit({0: 9.0, 1: 7.5, 2: 8.0, 4: 9.0, 8: 11.0})
    assert abs(base - 7.0) < 1e-9 and abs(slope - 0.5) < 1e-9


def test_the_draft_length_policy_models_a_trees_first_level_apart():
    """A tree whose first level is always accepted and whose deeper levels never are should not be drafted
    deep: the policy keeps the two acceptance rates apart (a chain's single rate would call it 50%)."""
    from policies import drafted

    from xtokspec.decode.policy import DraftLength

    policy = DraftLength(SpecConfig(tree_width=4, num_draft_tokens=4))
    for _ in range(30):  # K draft steps of 1 ms; verifying 4 nodes per step costs 10 ms + 0.5 ms per node
        k = policy.k
        nodes = 4 * k
        policy.observe(drafted(k, k, 1, 0.001 * k, 0.010 + 0.0005 * nodes, nodes=nodes, rejected=k > 1))
        policy.k = (policy.cycles % 4) + 1  # try every depth, as the measurements would come
    a1 = policy.first_successes / (policy.first_successes + policy.first_failures)
    a = policy.successes / (policy.successes + policy.failures)
    assert a1 > 0.9 and a < 0.1
    assert policy.next_k() == 1
    chain = DraftLength(SpecConfig(num_draft_tokens=4))
    assert not chain.tree


def test_the_draft_length_policy_leaves_a_prefills_draft_seconds_out_of_a_draft_step():
    """A cycle in which the draft read its whole context (the prompt, or a moved window) spent its draft seconds
    on that context, not on its K steps: counted as steps, a long prompt would make drafting look dear and the
    policy draft short for the next cycles."""
    from policies import drafted

    from xtokspec.decode.policy import DraftLength

    policy = DraftLength(SpecConfig(num_draft_tokens=4))
    policy.observe(drafted(4, 4, 3, 2.0, None))  # a prefill: 2 s of draft forwards over a long prompt
    assert policy.draft_step is None and policy.cycles == 1
    for _ in range(3):
        policy.observe(drafted(4, 4, 3, 0.004, 0.010))
    assert policy.draft_step == pytest.approx(0.001)


def test_the_residual_removes_rejected_children_and_falls_back_to_p_only_when_nothing_is_left():
    from xtokspec.decode.tree import residual

    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    torch.testing.assert_close(residual(p, [0, 2]), torch.tensor([0.0, 0.3, 0.0, 0.0]))
    assert residual(p, []) is p
    # rounding can leave the rejected children all the mass: then p itself (there is nothing else to draw)
    torch.testing.assert_close(residual(torch.tensor([0.6, 0.4, 0.0]), [0, 1]), torch.tensor([0.6, 0.4, 0.0]))


def test_trees_need_a_target_that_takes_tree_masks_and_a_sliding_target_is_refused(sp_tokenizer, bpe_tokenizer):
    """Verification applies a 4D tree mask: a target whose attention cannot (flash, flex) or whose layers are a
    ring buffer (sliding window) is refused by name, before any forward. A draft like that keeps the batch-row
    beam instead of growing its tree on its own cache."""
    from model_helpers import tiny_llama, tiny_neox

    draft = (tiny_neox(bpe_tokenizer), bpe_tokenizer)
    target = tiny_llama(sp_tokenizer, seed=21)
    target.config._attn_implementation = "flex_attention"
    spec = XTokSpec((target, sp_tokenizer), draft)
    with pytest.raises(XTokSpecError, match="attention implementation 'flex_attention'.*attn_implementation='sdpa'"):
        spec.generate("東京", max_new_tokens=4, tree_width=2)
    compiled = XTokSpec((target, sp_tokenizer), draft, config=SpecConfig(compile=True))
    with pytest.raises(XTokSpecError, match="attention implementation 'flex_attention'"):  # before compiling anything
        compiled.warmup("東京", max_new_tokens=4, tree_width=2, progress=False)
    assert not compiled.kept.steps
    assert ModelState(target, [5, 6], "dynamic", 16).grows_trees is False
    target.config._attn_implementation = "sdpa"
    assert ModelState(target, [5, 6], "dynamic", 16).grows_trees is True
    target.config.sliding_window, target.config.use_sliding_window = 4, True
    with pytest.raises(XTokSpecError, match="need full-attention layers in the target"):
        spec.generate("東京", max_new_tokens=4, tree_width=2)
    assert ModelState(target, [5, 6], "dynamic", 16).grows_trees is False


def test_a_compiled_tree_fills_its_bucket_for_free(ja_target):
    """Through a compiled step a trie forward is padded to its bucket, and padding rows cost what nodes do: the
    pruned trie may grow to the bucket's end (1 uncached id + 7 nodes = 8). Eagerly it may not."""
    model, _ = ja_target
    prompt = list(range(100, 120))
    with torch.inference_mode():
        compiled = tree_state(model, prompt, "static+step", [])
        eager = tree_state(model, prompt, "static")
        for state in (compiled, eager):
            state.forward(keep=1)
            state.ids.append(42)
    assert [compiled.tree_room(n) for n in (0, 1, 2, 3, 5, 7, 8, 15, 31)] == [0, 1, 3, 3, 7, 7, 15, 15, 31]
    assert [eager.tree_room(n) for n in (1, 5, 8)] == [1, 5, 8]
    compiled.ids.append(43)  # two uncached ids: 2 + 5 rows -> bucket 8, room for 6 nodes
    assert compiled.tree_room(5) == 6
