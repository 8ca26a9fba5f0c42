"""Triton adapter of the target_model model: tensors in and out, logic in
spec_decode.serving.target_model.TargetBackend."""

import triton_python_backend_utils as pb_utils

from spec_decode.serving.adapter import execute, model_parameters
from spec_decode.serving.metrics import Metrics
from spec_decode.serving.target_model import TargetBackend


class TritonPythonModel:
    def initialize(self, args):
        self.backend = TargetBackend(model_parameters(args), Metrics(pb_utils))

    def execute(self, requests):
        return execute(self.backend, requests, pb_utils)
