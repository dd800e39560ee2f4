"""The runtime: KV caches (`kv`), steps captured as CUDA graphs or compiled (`compile`), a model's ids with its
cache and step (`cache.ModelState`), and loading models with the heads xtokspec gives them (`models`)."""
