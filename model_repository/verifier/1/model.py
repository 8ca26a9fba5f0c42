"""Triton adapter of the verifier model: tensors in and out, logic in
spec_decode.serving.verifier_model.VerifierBackend."""

import triton_python_backend_utils as pb_utils

from spec_decode.serving.adapter import execute, model_parameters
from spec_decode.serving.metrics import Metrics
from spec_decode.serving.verifier_model import VerifierBackend


class TritonPythonModel:
    def initialize(self, args):
        self.backend = VerifierBackend(model_parameters(args), Metrics(pb_utils))

    def execute(self, requests):
        return execute(self.backend, requests, pb_utils)
