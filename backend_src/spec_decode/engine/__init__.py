"""The engine: causal LMs over a paged KV pool, the scorer, model loading, surgery, draft vocabularies."""
