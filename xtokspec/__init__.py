"""xtokspec: lossless speculative decoding across mismatched tokenizers.

    from xtokspec import XTokSpec
    spec = XTokSpec("path/to/large", "path/to/small")
    result = spec.generate("自然言語処理とは何か", max_new_tokens=128)
"""

from .spec import XTokSpec
from .types import GenerationResult, GenerationStats, SamplingParams, SpecConfig, XTokSpecError

__all__ = ["XTokSpec", "GenerationResult", "GenerationStats", "SamplingParams", "SpecConfig", "XTokSpecError"]
__version__ = "0.1.0"
