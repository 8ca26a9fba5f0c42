"""The client contract of ``generate``: a validated request (docs/client.md).

Its fields are generate's inputs (:data:`spec_decode.serving.wire.CLIENT`, the TensorRT-LLM and vLLM Triton backends'
names); :func:`spec_decode.serving.generate_inputs.parse_request` decodes the input tensors into one. Every check
raises :class:`~spec_decode.settings.InvalidInputError` naming the field and the allowed values, so ``generate`` can
answer with a Triton error response and keep serving.
"""

from __future__ import annotations

from dataclasses import dataclass

from .processors import ProcessorSpec
from .sampling import SamplingParams
from .settings import GenerateSettings, InvalidInputError, check_acceptance_method, in_range
from .tree import MAX_TREE_DEPTH, MAX_TREE_TOP_K

_DEFAULTS = GenerateSettings()


@dataclass(frozen=True)
class GenerationRequest:
    """A validated ``generate`` request (docs/client.md, "Client contract").

    Construction checks what does not depend on the server (sampling parameters, through
    :class:`~spec_decode.sampling.SamplingParams`; the acceptance method; the seed; the processors' ranges, through
    :class:`~spec_decode.processors.ProcessorSpec`; min_tokens <= max_tokens; the guide, through
    :func:`~spec_decode.processors.grammar.check_guide`); :func:`~spec_decode.serving.generate_inputs.parse_request`
    the rest.

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
    draft_tree: bool = _DEFAULTS.draft_tree  # drafts as a tree of at most num_draft_tokens nodes, or a chain
    tree_top_k: int = 0  # that tree's children per expanded node (EAGLE-2's top_k); 0: draft_model's config
    tree_depth: int = 0  # that tree's levels at most (EAGLE-2's depth); 0: draft_model's config
    speculative_method: str = _DEFAULTS.default_speculative_method
    acceptance_method: str = ""  # "" = the verifier's configured default
    # logits processors (spec_decode.processors): vLLM's formulas, TensorRT-LLM's names
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    guided_decoding_guide_type: str = ""  # "" = no structured output
    guided_decoding_guide: str = ""
    top_logprobs: int = 0
    prompt_logprobs: int = -1  # -1 = none
    return_num_input_tokens: bool = False  # the vLLM backend's usage outputs: the prompt's token count
    return_num_output_tokens: bool = False  # and each response's

    def __post_init__(self):
        SamplingParams(self.temperature, self.top_k, self.top_p)  # the sampling rules
        if self.random_seed is not None:
            in_range("random_seed", self.random_seed, 0)
        if self.acceptance_method:
            check_acceptance_method("acceptance_method", self.acceptance_method)
        in_range("tree_top_k", self.tree_top_k, 0, MAX_TREE_TOP_K, " (0: draft_model's config)")
        in_range("tree_depth", self.tree_depth, 0, MAX_TREE_DEPTH, " (0: draft_model's config)")
        # the processors' own rules (penalty ranges, top_logprobs, prompt_logprobs), on a stand-in prompt length
        ProcessorSpec(1, self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.min_tokens,
                      top_logprobs=self.top_logprobs, prompt_logprobs=self.prompt_logprobs)
        if self.min_tokens > self.max_tokens:
            raise InvalidInputError("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.guided_decoding_guide_type and self.ignore_eos:
            raise InvalidInputError("ignore_eos", "cannot be true with guided_decoding_guide_type: a finished grammar "
                                                  "allows only the end ids")
        if self.guided_decoding_guide_type:
            from .processors.grammar import check_guide  # the grammar engine: loaded by requests that use it

            check_guide(self.guided_decoding_guide_type, self.guided_decoding_guide)

    @property
    def wants_logprobs(self) -> bool:
        """Whether the tokens' log-probs are returned (``return_log_probs`` or ``top_logprobs`` > 0)."""
        return self.return_log_probs or self.top_logprobs > 0
