"""The verifier: accepts a prefix of the draft tokens (rejection sampling, lossless; typical acceptance, approximate).

Public API (:mod:`spec_decode.verifier.rejection`): ``rejection_sample`` and ``typical_acceptance_sample``. CUDA tensors
run the Triton kernels of :mod:`spec_decode.verifier.kernels`; CPU tensors the torch maths of
:mod:`spec_decode.verifier.torch_impl`.
"""

from .rejection import check_typical_parameters, rejection_sample, typical_acceptance_sample, validate_inputs

__all__ = ["check_typical_parameters", "rejection_sample", "typical_acceptance_sample", "validate_inputs"]
