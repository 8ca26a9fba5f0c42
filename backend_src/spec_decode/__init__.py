"""spec_decode: speculative decoding served from a Triton Inference Server model repository.

All logic lives here and is importable without Triton: proposers (draft LM, n-gram prompt lookup), the target scorer
with its per-sequence KV cache, the verifier (rejection sampling), the generation loop, and the server launcher. The
``model.py`` files of the Triton model repository are thin adapters over this package.
"""

__version__ = "0.1.0"
