"""Drafting for several requests at once: their draft caches side by side in one left-padded batch, one forward
per drafted position, each row's new cache columns handed back to its own request (xtokspec/vllm/proposer.py's proposer
uses it for every running request)."""

from __future__ import annotations

import time

import torch

from ..runtime.cache import ModelState
from ..runtime.kv import dynamic_cache, to_device


def prefill_tail(state: ModelState, limit: int | None = None) -> None:
    """Feed the state's uncached ids but the last (whose logits drafting needs), at most `limit` of them, without
    logits."""
    state.uncache_last(1)  # all cached (after a rollback): the last one is fed again
    new = state.ids[state.cached : -1]
    new = new if limit is None else new[:limit]
    if new:
        state._forward(state.model, to_device([new], state.device), logits_to_keep=1)
        state.kv.advance(len(new))


@torch.inference_mode()
def draft_together(model, states: list[ModelState], k: int, draft_eos: set[int], window: int | None = None,
                   first_ids: list[list[int] | None] | None = None,
                   heal: list[tuple[int, list[int]] | None] | None = None,
                   ) -> tuple[list[list[int]], float, list[bool]]:
    """k ids drafted greedily for every state, one batched forward per drafted position -> (each state's ids
    (stopped after a drafted EOS), appended to its ids with its cache covering all but the last, as
    `ChainProposer` leaves a single state; the seconds spent copying caches into the batch and back; per state,
    whether it healed). `first_ids`: per state, the ids its first drafted token may be (None: any: a state that
    restates an incomplete character). `heal`: per state, token healing's candidate (`TextBridge.heal_candidate`:
    its last id and the ids that may replace it) or None; such a state needs two uncached ids. As
    `ChainProposer._heal`, the draft chooses among those ids from the logits before the last id (the first
    forward keeps two rows); where it chooses another, that id is the first drafted one, written at the last id's
    position, whose column the row's mask then hides, and the last id leaves the state's ids and cache (the caller
    takes it back off its text: `TextBridge.heal` without the truncation).

    The states' caches (each request its own length: transformers DynamicCaches, or static ones, whose buffers and
    captured graphs stay where they are) are copied side by side into
    one batched cache, left-padded: row i holds its c_i cached positions right-aligned in the first C = max c_i
    columns, then its t_i uncached ids right-aligned in the next T = max t_i; an attention mask hides the padding
    and position ids carry each row's own positions. The k - 1 further forwards add one column each. Afterwards
    each state's cache gets its own new columns (its uncached ids and the drafted ones) written after its c_i; the batched
    cache is dropped. A draft with sliding-window layers (Gemma 2/3) batches while the batch's columns fit in its
    window (`window`: then its sliding layers hold every position, as full ones do). Every state needs a cached
    position (else its padding queries would see nothing) and an uncached id: `prefill_tail` leaves both where a
    state has two ids; rows with long uncached tails should be prefilled so too (every row pays for T columns)."""
    device = states[0].device
    if any(state.cached < 1 or state.cached >= len(state.ids) for state in states):
        raise ValueError("draft_together needs every state with cached ids and an uncached one (prefill_tail)")
    heal = heal or [None] * len(states)
    if any(h is not None and len(state.ids) - state.cached < 2 for state, h in zip(states, heal, strict=True)):
        raise ValueError("a state that may heal needs two uncached ids (the logits before its last one)")
    t0 = time.perf_counter()
    cached = [state.cached for state in states]
    tails = [state.ids[c:] for state, c in zip(states, cached, strict=True)]
    rows, width, depth = len(states), max(cached), max(len(t) for t in tails)
    if window is not None and width + depth + k - 1 > window - 1:
        raise ValueError(f"a batch of {width + depth + k - 1} columns does not fit the draft's sliding window ({window})")
    batch = dynamic_cache(model)
    if width:
        reference = next(s.kv.cache for s, c in zip(states, cached, strict=True) if c)
        for layer_idx, layer in enumerate(reference.layers):
            shape = (rows, layer.keys.shape[1], width, layer.keys.shape[3])
            keys, values = layer.keys.new_zeros(shape), layer.values.new_zeros(shape)
            for r, (state, c) in enumerate(zip(states, cached, strict=True)):
                if c:
                    keys[r, :, width - c :], values[r, :, width - c :] = state.kv.read(layer_idx, c)
            batch.update(keys, values, layer_idx)
    mask = torch.zeros(rows, width + depth + k - 1, dtype=torch.long)
    input_ids = torch.zeros(rows, depth, dtype=torch.long)
    positions = torch.zeros(rows, depth, dtype=torch.long)
    for r, (c, tail) in enumerate(zip(cached, tails, strict=True)):
        mask[r, width - c : width] = 1
        mask[r, width + depth - len(tail) :] = 1
        input_ids[r, depth - len(tail) :] = torch.tensor(tail)
        positions[r, depth - len(tail) :] = torch.arange(c, c + len(tail))
    mask, input_ids, positions = mask.to(device), input_ids.to(device), positions.to(device)
    copy_s = time.perf_counter() - t0
    keyword = states[0].cache_keyword
    healing = any(h is not None for h in heal)
    logits = model(input_ids=input_ids, attention_mask=mask[:, : width + depth], position_ids=positions,
                   use_cache=True, logits_to_keep=2 if healing else 1, **{keyword: batch}).logits  # (B, 1 or 2, Vd)
    after = logits[:, -1]  # (B, Vd)
    if first_ids is not None and any(ids for ids in first_ids):
        after = after.masked_fill(~allowed_ids(after.shape, first_ids).to(device), float("-inf"))
    token = torch.argmax(after, dim=-1)  # (B,)
    position = positions[:, -1:]
    healed = torch.zeros(rows, dtype=torch.bool, device=device)
    if healing:  # NOTE: on the device: the rows that heal are known on the host with the drafted ids
        before = logits[:, -2].masked_fill(~allowed_ids(after.shape, [h[1] if h else None for h in heal]).to(device),
                                           float("-inf"))
        choice = torch.argmax(before, dim=-1)  # (B,)
        last = to_device([h[0] if h else -1 for h in heal], device)  # (B,): -1 never equals a choice
        healed = (last >= 0) & (choice != last)
        token = torch.where(healed, choice, token)
        mask[:, width + depth - 1] *= (~healed).long()  # the last id's column, for the rows that replace it
        position = position - healed.long()[:, None]  # the replacing id takes the last id's position
    tokens = [token]
    for step in range(1, k):
        position = position + 1
        logits = model(input_ids=token[:, None], attention_mask=mask[:, : width + depth + step],
                       position_ids=position, use_cache=True, **{keyword: batch}).logits[:, -1]
        token = torch.argmax(logits, dim=-1)
        tokens.append(token)
    drafted = torch.stack(tokens, dim=1).tolist()  # the one transfer (with the rows that healed)
    healed_rows = healed.tolist()
    t0 = time.perf_counter()
    last_column = width + depth - 1
    for layer_idx, layer in enumerate(batch.layers):  # each row's new columns onto its own cache
        for r, (state, tail) in enumerate(zip(states, tails, strict=True)):
            start = width + depth - len(tail)
            keys, values = layer.keys[r : r + 1, :, start:], layer.values[r : r + 1, :, start:]
            if healed_rows[r]:  # without the last id's column: the replacing id took its place
                skip = last_column - start
                keys = torch.cat([keys[:, :, :skip], keys[:, :, skip + 1 :]], dim=2)
                values = torch.cat([values[:, :, :skip], values[:, :, skip + 1 :]], dim=2)
            state.kv.write(layer_idx, keys, values, cached[r])
    for state, tail, was_healed in zip(states, tails, healed_rows, strict=True):
        state.kv.advance(len(tail) - was_healed + k - 1)  # a sliding layer is cut back to its window (DynamicKV)
        if was_healed:
            del state.ids[-1]
    out = []
    for state, ids in zip(states, drafted, strict=True):
        base = len(state.ids)
        state.extend(ids)
        end = next((n + 1 for n, token_id in enumerate(ids) if token_id in draft_eos), len(ids))
        if end < len(ids):
            state.truncate(base + end)  # past a drafted EOS: dropped, its cache positions too
        out.append(ids[:end])
    return out, copy_s + time.perf_counter() - t0, healed_rows


def allowed_ids(shape: tuple[int, int], ids: list[list[int] | None]) -> torch.Tensor:
    """(B, V) bool on the host: per row, its `ids` (None or empty: every id)."""
    allowed = torch.zeros(shape, dtype=torch.bool)
    for r, row in enumerate(ids):
        if row:
            allowed[r, row] = True
        else:
            allowed[r] = True
    return allowed
