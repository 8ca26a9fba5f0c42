"""The client contract of ``generate``: a validated request (docs/client.md).

Its fields are generate's inputs (:data:`spec_decode.serving.wire.CLIENT`, the TensorRT-LLM and vLLM Triton backends'
names); :func:`spec_decode.serving.generate_inputs.parse_request` decodes the input tensors into one. Every check
raises :class:`~spec_decode.settings.InvalidInputError` naming the field and the allowed values, so ``generate`` can
answer with a Triton error response and keep serving.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import SamplingParams
from .settings import GenerateSettings, check_acceptance_method, in_range

_DEFAULTS = GenerateSettings()


@dataclass(frozen=True)
class GenerationRequest:
    """A validated ``generate`` request (docs/client.md, "Client contract").

    Construction checks what does not depend on the server (sampling parameters, through
    :class:`~spec_decode.sampling.SamplingParams`; the acceptance method; the seed);
    :func:`~spec_decode.serving.generate_inputs.parse_request` the rest.

    Raises:
        InvalidInputError: (construction) naming the field and the allowed values.
    """

    text_input: str
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    random_seed: int | None = None
    stop_words: tuple[str, ...] = ()
    end_id: int | None = None
    stream: bool = False  # as the TensorRT-LLM and vLLM backends: one response unless streaming is asked for
    exclude_input_in_output: bool = False
    return_log_probs: bool = False
    ignore_eos: bool = False  # as vLLM's: generate max_tokens tokens whatever the EOS token (end_id still stops)
    num_draft_tokens: int = _DEFAULTS.num_draft_tokens
    speculative_method: str = _DEFAULTS.default_speculative_method
    acceptance_method: str = ""  # "" = the verifier's configured default

    def __post_init__(self):
        SamplingParams(self.temperature, self.top_k, self.top_p)  # the sampling rules
        if self.random_seed is not None:
            in_range("random_seed", self.random_seed, 0)
        if self.acceptance_method:
            check_acceptance_method("acceptance_method", self.acceptance_method)
