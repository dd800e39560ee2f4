"""oneDNN linears (`models.onednn_linears`, `xtokspec bench --cpu-linears onednn`): every torch linear of a
float32 CPU model replaced by oneDNN's packed one. The converted model is a different model numerically (float
rounding), so losslessness is checked against the converted target's own `generate`."""

from __future__ import annotations

import pytest
import torch
from model_helpers import load_fixture_model
from test_greedy import NEW_TOKENS, check_prompts

from xtokspec.runtime.models import onednn_linears
from xtokspec.types import XTokSpecError


def _linears(model) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@pytest.fixture(scope="module")
def converted():
    """Own copies of the fixture target and the bridged draft (converted in place), and the target's logits on a
    prompt before conversion."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    target, draft = load_fixture_model("ja-target"), load_fixture_model("ja-draft-bpe")
    if target[0].device.type != "cpu":
        pytest.skip("a CPU case (XTOKSPEC_TEST_DEVICE is set)")
    ids = target[1]("表計算ドキュメントのセル範囲は、", return_tensors="pt").input_ids
    with torch.inference_mode():
        before = target[0](ids).logits
    counts = (_linears(target[0]), _linears(draft[0]))
    converted_counts = (onednn_linears(target[0]), onednn_linears(draft[0]))
    return target, draft, ids, before, counts, converted_counts


def test_every_linear_is_converted_and_the_logits_move_by_rounding_only(converted):
    target, draft, ids, before, counts, converted_counts = converted
    assert converted_counts == counts and counts[0] > 0 and counts[1] > 0
    assert _linears(target[0]) == 0 and _linears(draft[0]) == 0
    with torch.inference_mode():
        after = target[0](ids).logits
    assert after.shape == before.shape
    torch.testing.assert_close(after, before, atol=1e-3, rtol=1e-4)


@pytest.fixture(scope="module")
def converted_reference():
    return {}  # the converted target's own continuations, shared by the chain and the tree case


@pytest.mark.slow
@pytest.mark.parametrize("tree_width", [1, 4])
def test_greedy_equals_the_converted_targets_generate(tree_width, converted, heldout_prompts, converted_reference,
                                                      record_property):
    """Token-identical to the converted target's own `generate` (float32: only a near-tie may differ, reported
    with its logit margin), for the chain and a token tree; and the draft still proposes (a draft that never
    matched would pass the equality)."""
    from xtokspec import SpecConfig, XTokSpec

    target, draft = converted[:2]
    spec = XTokSpec(target, draft, config=SpecConfig(tree_width=tree_width))
    near_ties = check_prompts(spec, target, heldout_prompts[:8], NEW_TOKENS, converted_reference)
    record_property("near_ties", near_ties)
    stats = [spec.generate(p, max_new_tokens=NEW_TOKENS).stats for p in heldout_prompts[:4]]
    assert sum(s.accepted for s in stats) > 0


def test_refuses_a_model_that_is_not_float32_and_changes_nothing():
    model, _ = load_fixture_model("ja-draft-bpe")
    model = model.to(torch.bfloat16)
    before = _linears(model)
    with pytest.raises(XTokSpecError, match="need a float32 model on the CPU; .* is bfloat16"):
        onednn_linears(model)
    assert _linears(model) == before  # checked before anything was replaced


def test_keep_head_leaves_the_output_head_a_torch_linear():
    model, _ = load_fixture_model("ja-draft-bpe")
    if model.device.type != "cpu":
        pytest.skip("a CPU case (XTOKSPEC_TEST_DEVICE is set)")
    onednn_linears(model, keep_head=True)
    assert type(model.get_output_embeddings()) is torch.nn.Linear and _linears(model) == 1
