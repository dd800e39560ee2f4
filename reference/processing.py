"""Logit processing with transformers' meaning: temperature, then top-k, then top-p, then softmax.

Shapes: V = vocabulary size; ``logits`` is (V,). All arithmetic is float64.

The order and the tie rules follow transformers' ``generate`` warpers
(``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``, each with
``min_tokens_to_keep=1``):

- temperature: ``logits / temperature``.
- top-k: keep every token whose logit is >= the k-th largest logit, so tokens tied with the
  k-th value are all kept (more than k tokens may survive). ``top_k`` of 0 or None disables it;
  a ``top_k`` larger than V keeps everything.
- top-p: sort the surviving logits ascending, take the cumulative softmax, remove the tokens
  whose cumulative probability is <= 1 - top_p, and always keep the most likely token.
  ``top_p = 1.0`` disables it. NOTE: among tokens with equal logits the ascending sort is
  stable here (lower index first, so removed first); torch's default sort gives no such
  promise, so exact parity on ties at the top-p boundary needs ``torch.sort(stable=True)``.

``greedy`` is argmax of the raw logits, first index on ties (like ``torch.argmax``).
"""

import numpy as np


def validate_logits(logits: np.ndarray) -> np.ndarray:
    """Return ``logits`` as float64 (V,); raise ValueError on NaN, +inf, or no finite entry."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
    if np.isnan(logits).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(logits).any():
        raise ValueError("logits contain +inf")
    if not np.isfinite(logits).any():
        raise ValueError("logits are all -inf: no token can be sampled")
    return logits


def validate_sampling_params(temperature: float, top_k: int | None, top_p: float) -> None:
    """Raise ValueError unless temperature > 0, top_k >= 0 (or None) and 0 < top_p <= 1."""
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 for sampling, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 or None disables it), got {top_k}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1.0 disables it), got {top_p}")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax of (V,) logits that may hold -inf (those get probability exactly 0)."""
    shifted = logits - np.max(logits)
    weights = np.exp(shifted)  # exp(-inf) == 0
    return weights / weights.sum()


def top_k_mask(logits: np.ndarray, top_k: int | None) -> np.ndarray:
    """(V,) bool, True where a token survives top-k: logit >= the k-th largest (ties kept)."""
    if not top_k or top_k >= logits.size:
        return np.ones(logits.size, dtype=bool)
    kth_largest = np.sort(logits)[-top_k]
    return logits >= kth_largest


def top_p_mask(logits: np.ndarray, top_p: float) -> np.ndarray:
    """(V,) bool, True where a token survives top-p (transformers' TopPLogitsWarper)."""
    if top_p >= 1.0:
        return np.ones(logits.size, dtype=bool)
    order = np.argsort(logits, kind="stable")  # ascending
    cumulative = np.cumsum(softmax(logits[order]))
    remove_sorted = cumulative <= 1.0 - top_p
    remove_sorted[-1] = False  # min_tokens_to_keep = 1: the most likely token always stays
    keep = np.ones(logits.size, dtype=bool)
    keep[order[remove_sorted]] = False
    return keep


def process_logits(
    logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0
) -> np.ndarray:
    """Sampling distribution (V,) for raw ``logits`` (V,): temperature -> top-k -> top-p -> softmax.

    Invariant: the result is non-negative, sums to 1, and its support is the tokens kept by
    top-k and then top-p; each step only removes tokens, never re-weights the survivors.
    """
    logits = validate_logits(logits)
    validate_sampling_params(temperature, top_k, top_p)
    scaled = logits / temperature  # (V,)
    scaled = np.where(top_k_mask(scaled, top_k), scaled, -np.inf)
    scaled = np.where(top_p_mask(scaled, top_p), scaled, -np.inf)
    return softmax(scaled)


def greedy(logits: np.ndarray) -> int:
    """The greedy token: argmax of the raw logits, first index on ties (like torch.argmax)."""
    return int(np.argmax(validate_logits(logits)))
