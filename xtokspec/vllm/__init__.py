"""xtokspec inside vLLM: `TextBridgeProposer`, the class users name in vLLM's speculative_config
(`"model": "xtokspec.vllm.TextBridgeProposer"`); see `proposer` for how it works."""

from .proposer import TextBridgeProposer

__all__ = ["TextBridgeProposer"]
