"""Triton adapter of the decoupled ``generate_trtllm`` model (generate in the request format of NVIDIA's OpenAI
frontend); the logic is spec_decode.serving.trtllm_format.TrtllmFormatBackend."""

import asyncio

import triton_python_backend_utils as pb_utils

from spec_decode.serving.trtllm_format import TrtllmFormatBackend


class TritonPythonModel:
    """The Python backend's entry points for ``generate_trtllm`` (decoupled: responses go through each request's
    sender)."""

    def initialize(self, args):
        """Build the backend (it has no config parameters)."""
        self.backend = TrtllmFormatBackend(pb_utils)

    async def execute(self, requests):
        """Relay the requests to generate concurrently, each to completion; returns None (decoupled)."""
        # As generate's model.py: let the stub register this coroutine's future before a request can end.
        await asyncio.sleep(0.002)
        await asyncio.gather(*(self.backend.handle(r) for r in requests))
        return None

    def finalize(self):
        """Stop the backend's thread pool."""
        self.backend.close()
