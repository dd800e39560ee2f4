"""NumPy/SciPy reference of speculative rejection sampling (no torch, no transformers).

p = target distribution, q = proposal (draft) distribution, as in Leviathan et al. 2023 (Chen et
al. 2023 swap the letters). K = num_draft_tokens, V = vocabulary size. Everything is float64 and
every random draw is an explicit argument, so the torch implementation can be replayed exactly.
"""

from reference.chisquare import (
    FALSE_FAILURE_BUDGET,
    ChiSquareResult,
    InvalidTestError,
    assert_same_distribution,
    assert_samples_match,
    chisquare_test,
    control_miss_probability,
    count_samples,
    noncentrality_per_run,
    per_test_alpha,
)
from reference.exact import (
    TableLM,
    acceptance_probs,
    accepted_count_distribution,
    all_continuations,
    block_output_distribution,
    onehot_guesses_output_distribution,
    sequence_distribution,
    speculative_generate,
    truncate_at_eos,
)
from reference.keyed import (
    coupled_match_law,
    coupled_roots,
    coupled_roots_hit,
    coupling_bound,
    keyed_noise,
    keyed_sample,
    keyed_uniforms,
    keyed_verify,
)
from reference.processing import greedy, process_logits
from reference.rejection import (
    UNMAPPED,
    BlockResult,
    map_proposal,
    onehot_block,
    sample_race,
    speculative_block,
)

__all__ = [
    "coupled_match_law",
    "coupling_bound",
    "coupled_roots",
    "coupled_roots_hit",
    "keyed_noise",
    "keyed_sample",
    "keyed_uniforms",
    "keyed_verify",
    "FALSE_FAILURE_BUDGET",
    "UNMAPPED",
    "BlockResult",
    "ChiSquareResult",
    "InvalidTestError",
    "TableLM",
    "acceptance_probs",
    "accepted_count_distribution",
    "all_continuations",
    "assert_same_distribution",
    "assert_samples_match",
    "block_output_distribution",
    "onehot_guesses_output_distribution",
    "chisquare_test",
    "control_miss_probability",
    "count_samples",
    "greedy",
    "map_proposal",
    "noncentrality_per_run",
    "onehot_block",
    "per_test_alpha",
    "process_logits",
    "sample_race",
    "sequence_distribution",
    "speculative_block",
    "speculative_generate",
    "truncate_at_eos",
]
