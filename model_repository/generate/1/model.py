"""Triton adapter of the decoupled generate model; logic in spec_decode.serving.generate.GenerateBackend."""

import asyncio

import triton_python_backend_utils as pb_utils

from spec_decode.serving.adapter import model_parameters, sibling_parameters
from spec_decode.serving.generate import GenerateBackend


class TritonPythonModel:
    def initialize(self, args):
        self.backend = GenerateBackend(model_parameters(args), pb_utils, sibling_parameters(args, "draft_model"))

    async def execute(self, requests):
        # Decoupled async execute: every request streams its own responses; requests run concurrently.
        # The stub registers this coroutine's future just after scheduling it; a coroutine that finishes before that
        # (a request rejected at once) makes the stub log "Cannot remove future from background". Yield briefly first.
        await asyncio.sleep(0.002)
        await asyncio.gather(*(self.backend.handle(r) for r in requests))
        return None
