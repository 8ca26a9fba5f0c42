"""The engine: causal LMs with per-sequence KV caches (LRU), the scorer, model loading, surgery, draft vocabularies."""
