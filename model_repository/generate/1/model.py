"""Triton adapter of the decoupled ``generate`` model; the logic is spec_decode.serving.generate.GenerateBackend."""

import asyncio

import triton_python_backend_utils as pb_utils

from spec_decode.serving.adapter import model_parameters, sibling_parameters
from spec_decode.serving.generate import GenerateBackend


class TritonPythonModel:
    """The Python backend's entry points for ``generate`` (decoupled: responses go through each request's sender)."""

    def initialize(self, args):
        """Build the backend from generate's config.pbtxt parameters and, when beside it, draft_model's."""
        self.backend = GenerateBackend(model_parameters(args), pb_utils, sibling_parameters(args, "draft_model"))

    async def execute(self, requests):
        """Serve the requests concurrently, each to completion; returns None (decoupled)."""
        # The stub registers this coroutine's future just after scheduling it; a coroutine that finishes before that
        # (a request rejected at once) makes the stub log "Cannot remove future from background". Yield briefly first.
        await asyncio.sleep(0.002)
        await asyncio.gather(*(self.backend.handle(r) for r in requests))
        return None
