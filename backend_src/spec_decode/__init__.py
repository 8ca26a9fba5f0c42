"""spec_decode: speculative decoding served from a Triton Inference Server model repository.

All logic lives here and is importable without Triton: the proposers behind one registry (draft LM, n-gram prompt
lookup, suffix decoding, hybrid), the target scorer with its per-sequence KV cache, the verifier (rejection sampling
and typical acceptance, Triton kernels and torch), the generation state machine, the models' backends and settings,
and the server launcher with its healer. The ``model.py`` files of the Triton model repository are thin adapters over
``spec_decode.serving`` (README, "Code layout").
"""

__version__ = "0.1.0"
