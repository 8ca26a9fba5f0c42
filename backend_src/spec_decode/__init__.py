"""spec_decode: speculative decoding served from a Triton Inference Server model repository.

Importable without Triton; the ``model.py`` files of the model repository are thin adapters over
:mod:`spec_decode.serving` (docs/architecture.md, "Package layout by role"). What lives where:

- root: the step contract: :mod:`.protocol` (a step's inputs and result), :mod:`.generation` (one request's state
  machine), :mod:`.request` (generate's client inputs), :mod:`.sampling`, :mod:`.settings`, :mod:`.sequences`
  (per-sequence caches' LRU) and :mod:`.in_process` (the in-process transport).
- :mod:`.scheduler`: the round's policy and its loop: k per step, ``disable_by_batch_size``, the token budget
  (chunked prefill), ``auto``'s choice of proposer and k with the round's cost it weighs, and the frozen round plan
  both transports run.
- :mod:`.engine`: causal LMs over a paged KV pool, the target scorer, model loading and surgery.
- :mod:`.processors`: logits processors applied at every draft position, structured output, log-probs.
- :mod:`.proposers`: the drafters behind one registry (draft LM, EAGLE head, n-gram, suffix decoding, hybrid).
- :mod:`.verifier`: rejection sampling and typical acceptance, as Triton kernels (CUDA) and in torch (CPU).
- :mod:`.serving`: the Triton models' backends, batching of rounds, metrics, and the wire format of the tensors.
- :mod:`.launcher`: starts tritonserver on the model repository and heals its model processes.
- :mod:`.openai_api`: the OpenAI-compatible HTTP server in front of ``generate``.
- :mod:`.training`: the tools that build trained proposers (corpus, teacher, draft LM, EAGLE speculator).
"""

__version__ = "0.1.0"
