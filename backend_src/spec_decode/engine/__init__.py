"""The engine: causal LMs with per-sequence KV caches, the scorer, model loading and surgery, draft vocabularies."""
