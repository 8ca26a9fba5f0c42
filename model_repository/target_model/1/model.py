"""Triton adapter of the ``target_model`` model: tensors in and out; the logic is
spec_decode.serving.target_model.TargetBackend."""

import triton_python_backend_utils as pb_utils

from spec_decode.serving.adapter import execute, model_parameters, sibling_parameters
from spec_decode.serving.metrics import Metrics
from spec_decode.serving.target_model import TargetBackend


class TritonPythonModel:
    """The Python backend's entry points for ``target_model``."""

    def initialize(self, args):
        """Build the backend from the model's config.pbtxt parameters (and its instance's GPU)."""
        self.backend = TargetBackend(model_parameters(args), Metrics(pb_utils),
                                     sibling_parameters(args, "draft_model"))

    def execute(self, requests):
        """One response per request, in order (spec_decode.serving.adapter.execute)."""
        return execute(self.backend, requests, pb_utils)
