"""NumPy/SciPy reference of speculative rejection sampling (no torch, no transformers)."""
