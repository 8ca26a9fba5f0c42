"""Triton adapter of the ``draft_model`` model: tensors in and out; the logic is
spec_decode.serving.draft_model.DraftBackend."""

import triton_python_backend_utils as pb_utils

from spec_decode.serving.adapter import execute, model_parameters, sibling_parameters
from spec_decode.serving.draft_model import DraftBackend
from spec_decode.serving.metrics import Metrics


class TritonPythonModel:
    """The Python backend's entry points for ``draft_model``."""

    def initialize(self, args):
        """Build the backend from the model's config.pbtxt parameters (and its instance's GPU)."""
        self.backend = DraftBackend(model_parameters(args), Metrics(pb_utils),
                                    sibling_parameters(args, "target_model"))

    def execute(self, requests):
        """One response per request, in order (spec_decode.serving.adapter.execute)."""
        return execute(self.backend, requests, pb_utils)
