"""The verifier: accepts a prefix of the draft tokens so the output follows the target distribution.

``rejection_sample`` is the public API (see :mod:`spec_decode.verifier.rejection`).
"""

from .rejection import rejection_sample, validate_inputs

__all__ = ["rejection_sample", "validate_inputs"]
