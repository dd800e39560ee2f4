"""A vLLM `custom_class` proposer that never proposes (`vllm_bench.py`'s `null` system): what vLLM's speculative
path costs by itself, every step verifying zero drafted tokens, against the target alone."""


class NullProposer:
    def __init__(self, vllm_config, *args, **kwargs):
        self.k = vllm_config.speculative_config.num_speculative_tokens

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load."""

    def dummy_run(self, *args, **kwargs) -> None:
        """Nothing to warm up."""

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]
