"""KV-cache rollback: after truncating and feeding other ids, logits equal a fresh forward."""

from __future__ import annotations

import torch
from model_helpers import tiny_llama

from xtokspec.cache import ModelState


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_rollback_equals_fresh_forward(sp_tokenizer):
    model = tiny_llama(sp_tokenizer, seed=3)
    state = ModelState(model, [1, 10, 11, 12])
    with torch.inference_mode():
        state.forward(keep=1)
        state.ids += [20, 21, 22, 23]  # a speculative block ...
        state.forward(keep=4)
        state.truncate(5)  # ... of which one token is accepted
        assert state.cached == 5 and state.ids == [1, 10, 11, 12, 20]
        state.ids += [30, 31]
        got = state.forward(keep=1)[-1]
    torch.testing.assert_close(got, fresh_logits(model, [1, 10, 11, 12, 20, 30, 31]), rtol=1e-5, atol=1e-5)


def test_forward_after_full_rollback_recomputes_the_last_position(sp_tokenizer):
    model = tiny_llama(sp_tokenizer, seed=4)
    state = ModelState(model, [1, 5, 6, 7])
    with torch.inference_mode():
        state.ids += [8, 9]
        state.forward(keep=1)
        state.truncate(4)  # everything left is cached: nothing new to feed
        got = state.forward(keep=1)[-1]
    torch.testing.assert_close(got, fresh_logits(model, [1, 5, 6, 7]), rtol=1e-5, atol=1e-5)
