"""spec_decode: speculative decoding served from a Triton Inference Server model repository.

Importable without Triton; the ``model.py`` files of the model repository are thin adapters over
:mod:`spec_decode.serving` (docs/architecture.md, "Package layout by role"). What lives where:

- root: the step contract: :mod:`.protocol` (a step's inputs and result), :mod:`.generation` (one request's state
  machine), :mod:`.request` (generate's client inputs), :mod:`.sampling`, :mod:`.settings`, :mod:`.schedule` (k per
  step) and :mod:`.in_process` (the in-process transport).
- :mod:`.engine`: causal LMs with per-sequence KV caches, the target scorer, model loading and surgery.
- :mod:`.proposers`: the drafters behind one registry (draft LM, EAGLE head, n-gram, suffix decoding, hybrid).
- :mod:`.verifier`: rejection sampling and typical acceptance, as Triton kernels (CUDA) and in torch (CPU).
- :mod:`.serving`: the Triton models' backends, batching of rounds, metrics, and the wire format of the tensors.
- :mod:`.launcher`: starts tritonserver on the model repository and heals its model processes.
- :mod:`.training`: the tools that build trained proposers (corpus, teacher, draft LM, EAGLE speculator).
"""

__version__ = "0.1.0"
