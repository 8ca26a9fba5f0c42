"""Triton adapter of the draft_model model: tensors in and out, logic in
spec_decode.serving.draft_model.DraftBackend."""

import triton_python_backend_utils as pb_utils

from spec_decode.serving.adapter import execute, model_parameters
from spec_decode.serving.draft_model import DraftBackend
from spec_decode.serving.metrics import Metrics


class TritonPythonModel:
    def initialize(self, args):
        self.backend = DraftBackend(model_parameters(args), Metrics(pb_utils))

    def execute(self, requests):
        return execute(self.backend, requests, pb_utils)
