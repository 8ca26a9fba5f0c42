"""Logits processors applied exactly at every draft position, and log-probs (docs/client.md).

:mod:`.core` holds the processors (penalties, min_tokens, bad words, structured output) and their per-row spec,
:mod:`.grammar` the structured-output matchers, :mod:`.logprobs` the emitted and prompt tokens' log-probs.
"""

from .core import LOGPROBS_MODES, MAX_TOP_LOGPROBS, ProcessorSpec, parse_spec, process_logits
from .grammar import GUIDE_TYPES
from .logprobs import TokenLogprobs, logprob_arrays, step_logprobs, token_logprobs

__all__ = ["GUIDE_TYPES", "LOGPROBS_MODES", "MAX_TOP_LOGPROBS", "ProcessorSpec", "TokenLogprobs", "logprob_arrays",
           "parse_spec", "process_logits", "step_logprobs", "token_logprobs"]
