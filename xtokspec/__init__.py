"""xtokspec: lossless speculative decoding across mismatched tokenizers."""
