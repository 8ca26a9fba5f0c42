"""The wire format: every tensor of every model in the repository (name, Triton dtype, dims), and the scalar decoder.

The one place that names the tensors. Each model's config.pbtxt must declare exactly what :data:`MODELS` says,
and each ensemble's ``input_map``/``output_map`` must be what :func:`ensemble_maps` derives
(``tests/unit/serving/test_wire.py`` holds every config.pbtxt to it). Step tensors (:data:`STEP`) have one dtype
and shape wherever they appear; ``generate``'s client tensors (:data:`CLIENT`) follow the TensorRT-LLM and vLLM
Triton backends' names, and ``generate_trtllm`` (the same tensors, ``max_batch_size`` 1, for NVIDIA's OpenAI frontend)
declares them too. Dims are per row: batched models (``max_batch_size`` > 0) add the batch dimension in front.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ..settings import InvalidInputError, decode_text

# the ensembles generate calls (score_step: rounds without drafts; greedy_step: greedy rounds, without the verifier)
SPEC_STEP, SCORE_STEP, GREEDY_STEP = "spec_step", "score_step", "greedy_step"
GENERATE, GENERATE_TRTLLM = "generate", "generate_trtllm"  # the client models (generate_trtllm: batched, over BLS)
STEP_PARTS = ("draft_model", "target_model", "verifier")  # the models the ensembles run
PAD_ID = -1  # pads rows of token-id tensors (never a token id)

_NUMPY = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT32": np.uint32, "UINT64": np.uint64,
          "FP32": np.float32, "STRING": np.object_}
_KINDS = {"BOOL": "biu", "INT32": "iu", "INT64": "iu", "UINT32": "iu", "UINT64": "iu", "FP32": "f", "STRING": "OSU"}
_WHAT = {"BOOL": "BOOL", "INT32": "integer", "INT64": "integer", "UINT32": "integer", "UINT64": "integer",
         "FP32": "FP32", "STRING": "string"}


@dataclass(frozen=True)
class Tensor:
    """One input or output as config.pbtxt declares it.

    Attributes:
        name: the tensor's name.
        dtype: Triton's data type without ``TYPE_`` (``BOOL``, ``INT32``, ``INT64``, ``UINT32``, ``UINT64``, ``FP32``,
            ``STRING``).
        dims: per-row dims (-1: any length).
        optional: an input the request may leave out.
        ragged: ``allow_ragged_batch`` (requests' rows of different lengths are handed to ``execute`` unpadded).
    """

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    ragged: bool = False

    @property
    def numpy_dtype(self) -> type:
        """The numpy dtype the tensor travels as (``object`` for STRING: bytes)."""
        return _NUMPY[self.dtype]


def _table(*tensors: Tensor) -> dict[str, Tensor]:
    return {t.name: t for t in tensors}


# Every step tensor, one dtype and shape wherever it appears ([1] per row: one value per sequence).
STEP: dict[str, Tensor] = _table(
    Tensor("sequence_id", "UINT64", (1,)),
    Tensor("token_ids", "INT64", (-1,)),  # committed ids, rows padded with PAD_ID
    Tensor("num_draft_tokens", "INT32", (1,)),
    Tensor("speculative_method", "STRING", (1,)),
    Tensor("temperature", "FP32", (1,)),
    Tensor("top_k", "INT32", (1,)),
    Tensor("top_p", "FP32", (1,)),
    Tensor("random_seed", "INT64", (1,)),
    Tensor("seeded", "BOOL", (1,)),  # the seed came from the client: drafts depend on the request alone
    Tensor("step", "INT64", (1,)),
    Tensor("release", "BOOL", (1,)),  # end the sequence: free its caches
    Tensor("acceptance_method", "STRING", (1,)),
    Tensor("context_hidden_states", "FP32", (-1, -1)),  # [m, H] the target's states before the last token
    Tensor("num_context_hidden_states", "INT32", (1,)),
    Tensor("draft_token_ids", "INT64", (-1,)),  # [k]
    # [k] each draft's parent among the row's drafts, -1 = the last committed token (spec_decode.tree); a chain is
    # [-1, 0, 1, ...]; absent or empty: a chain
    Tensor("draft_parents", "INT32", (-1,)),
    Tensor("draft_tree", "BOOL", (1,)),  # the row may be drafted as a tree (else a chain)
    Tensor("tree_top_k", "INT32", (1,)),  # its tree's children per expanded node (0: draft_model's config)
    Tensor("tree_depth", "INT32", (1,)),  # its tree's levels at most (0: draft_model's config)
    Tensor("draft_probs", "FP32", (-1, -1)),  # [k, V], or [0, 0] without draft probabilities
    Tensor("target_probs", "FP32", (-1, -1)),  # [k+1, V], or [0, 0] for a greedy row without log-probs
    # a greedy row without log-probs: the argmax of each of its k+1 distributions and its probability (all the argmax
    # walk reads; [0] for other rows, whose target_probs hold the rows)
    Tensor("target_argmax", "INT64", (-1,)),
    Tensor("target_argmax_probs", "FP32", (-1,)),
    Tensor("hidden_states", "FP32", (-1, -1)),  # [k+1, H] the target's last hidden states
    Tensor("output_ids", "INT64", (-1,)),  # [n] accepted drafts, then the recovered or bonus token
    Tensor("output_log_probs", "FP32", (-1,)),
    Tensor("logits_processors", "STRING", (1,)),  # the row's ProcessorSpec as JSON ("" = none)
    Tensor("log_probs", "FP32", (-1, -1)),  # [k+1, V] raw log-prob rows, or [0, 0] (the verifier uses target_probs)
    Tensor("output_token_ranks", "INT64", (-1,)),  # [n] 1-based rank of each output id (with log-probs asked for)
    Tensor("top_log_probs", "FP32", (-1, -1)),  # [n, N] the N most probable tokens' log-probs per output position
    Tensor("top_log_prob_ids", "INT64", (-1, -1)),  # [n, N] their ids
    Tensor("prompt_log_probs", "FP32", (-1,)),  # [P-1] prompt tokens 1..P-1 (a first step that asks for them)
    Tensor("prompt_token_ranks", "INT64", (-1,)),
    Tensor("prompt_top_log_probs", "FP32", (-1, -1)),
    Tensor("prompt_top_log_prob_ids", "INT64", (-1, -1)),
    # the row's share of the round's token budget (chunked prefill): new positions target_model may compute for it; a
    # row without drafts whose uncached prompt is longer is prefilled in part, and scores nothing (0: no bound)
    Tensor("num_scheduled_tokens", "INT32", (1,)),
    Tensor("num_cached_tokens", "INT32", (1,)),  # leading token_ids the target reused from its cache (vLLM's name)
    Tensor("target_forward_seconds", "FP32", (1,)),  # the forward that scored the row (shared by its batch)
)

# generate's client tensors (TensorRT-LLM / vLLM backend names).
CLIENT: dict[str, Tensor] = _table(
    Tensor("text_input", "STRING", (1,)),
    Tensor("max_tokens", "INT32", (1,)),
    Tensor("temperature", "FP32", (1,), optional=True),
    Tensor("top_p", "FP32", (1,), optional=True),
    Tensor("top_k", "INT32", (1,), optional=True),
    Tensor("random_seed", "UINT64", (1,), optional=True),
    Tensor("seed", "UINT64", (1,), optional=True),  # random_seed's name in the OpenAI frontend's TensorRT-LLM requests
    Tensor("stop_words", "STRING", (-1,), optional=True),
    Tensor("end_id", "INT32", (1,), optional=True),
    Tensor("stream", "BOOL", (1,), optional=True),
    Tensor("exclude_input_in_output", "BOOL", (1,), optional=True),
    Tensor("return_log_probs", "BOOL", (1,), optional=True),
    Tensor("ignore_eos", "BOOL", (1,), optional=True),
    Tensor("num_draft_tokens", "INT32", (1,), optional=True),
    Tensor("draft_tree", "BOOL", (1,), optional=True),  # drafts as a tree (default: generate's config) or a chain
    Tensor("tree_top_k", "INT32", (1,), optional=True),  # the tree's children per node (0: draft_model's config)
    Tensor("tree_depth", "INT32", (1,), optional=True),  # the tree's levels at most (0: draft_model's config)
    Tensor("speculative_method", "STRING", (1,), optional=True),
    Tensor("acceptance_method", "STRING", (1,), optional=True),
    Tensor("repetition_penalty", "FP32", (1,), optional=True),
    Tensor("presence_penalty", "FP32", (1,), optional=True),
    Tensor("frequency_penalty", "FP32", (1,), optional=True),
    Tensor("min_tokens", "INT32", (1,), optional=True),
    Tensor("min_length", "INT32", (1,), optional=True),  # min_tokens' older TensorRT-LLM name
    Tensor("bad_words", "STRING", (-1,), optional=True),
    Tensor("stop_token_ids", "INT32", (-1,), optional=True),
    Tensor("guided_decoding_guide_type", "STRING", (1,), optional=True),
    Tensor("guided_decoding_guide", "STRING", (1,), optional=True),
    Tensor("top_logprobs", "INT32", (1,), optional=True),
    Tensor("prompt_logprobs", "INT32", (1,), optional=True),
    Tensor("beam_width", "INT32", (1,), optional=True),  # refused above 1
    Tensor("num_return_sequences", "INT32", (1,), optional=True),  # refused above 1
    Tensor("n", "INT32", (1,), optional=True),  # vLLM's name of the same; refused above 1
    Tensor("return_num_input_tokens", "BOOL", (1,), optional=True),  # the vLLM backend's usage outputs
    Tensor("return_num_output_tokens", "BOOL", (1,), optional=True),
    # outputs
    Tensor("text_output", "STRING", (-1,)),
    Tensor("output_ids", "INT32", (-1,)),
    Tensor("output_log_probs", "FP32", (-1,)),
    Tensor("cum_log_probs", "FP32", (1,)),
    Tensor("num_steps", "INT32", (1,)),
    Tensor("num_draft_tokens_total", "INT32", (1,)),
    Tensor("num_accepted_tokens", "INT32", (1,)),
    Tensor("num_emitted_tokens", "INT32", (1,)),
    Tensor("finish_reason", "STRING", (1,)),
    Tensor("output_token_ranks", "INT32", (-1,)),
    Tensor("top_log_probs", "FP32", (-1, -1)),
    Tensor("top_log_prob_ids", "INT32", (-1, -1)),
    Tensor("prompt_log_probs", "FP32", (-1,)),
    Tensor("prompt_token_ranks", "INT32", (-1,)),
    Tensor("prompt_top_log_probs", "FP32", (-1, -1)),
    Tensor("prompt_top_log_prob_ids", "INT32", (-1, -1)),
    Tensor("auto_methods", "STRING", (-1,)),  # speculative_method=auto: the method of each step
    Tensor("auto_num_draft_tokens", "INT32", (-1,)),  # and its k
    Tensor("auto_draft_trees", "BOOL", (-1,)),  # and whether it drafted a tree
    Tensor("auto_tree_top_k", "INT32", (-1,)),  # and that tree's width (0: a chain, the config's width, or none)
    Tensor("num_input_tokens", "UINT32", (1,)),  # the prompt's tokens
    Tensor("num_output_tokens", "UINT32", (1,)),  # the tokens of this response (a stream's sum to the completion's)
)


def _pick(table: dict[str, Tensor], names: str, optional: str = "", ragged: str = "") -> tuple[Tensor, ...]:
    """The tensors named (space-separated) in ``names``, with the flags of those in ``optional`` and ``ragged``."""
    opt, rag = set(optional.split()), set(ragged.split())
    return tuple(replace(table[n], optional=n in opt or table[n].optional, ragged=n in rag) for n in names.split())


@dataclass(frozen=True)
class ModelWire:
    """A model's tensors as its config.pbtxt declares them.

    Attributes:
        inputs: its inputs, in config order.
        outputs: its outputs, in config order.
        steps: for an ensemble, the models it runs in order (their maps: :func:`ensemble_maps`); else empty.
    """

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    steps: tuple[str, ...] = ()

    @property
    def input_names(self) -> tuple[str, ...]:
        """The inputs' names, in config order."""
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        """The outputs' names, in config order."""
        return tuple(t.name for t in self.outputs)


_DRAFT_IN = ("sequence_id token_ids num_draft_tokens speculative_method temperature top_k top_p random_seed seeded "
             "step release context_hidden_states num_context_hidden_states logits_processors draft_tree tree_top_k "
             "tree_depth")
_TARGET_IN = ("sequence_id token_ids draft_token_ids temperature top_k top_p release logits_processors "
              "num_scheduled_tokens draft_parents")
_TARGET_FACTS = "num_cached_tokens target_forward_seconds"  # what the target measured: generate's scheduler reads them
_VERIFIER_IN = ("target_probs draft_token_ids draft_probs temperature random_seed step acceptance_method "
                "logits_processors log_probs token_ids seeded target_argmax target_argmax_probs draft_parents")
_PROMPT_OUT = "prompt_log_probs prompt_token_ranks prompt_top_log_probs prompt_top_log_prob_ids"
_LOGPROBS_OUT = "output_token_ranks top_log_probs top_log_prob_ids " + _PROMPT_OUT
# the prompt's log-probs in the order of logprob_arrays (spec_decode.processors): log-probs, ranks, top log-probs, ids
PROMPT_LOGPROB_OUTPUTS = tuple(_PROMPT_OUT.split())

_GENERATE = ModelWire(
    _pick(CLIENT, "text_input max_tokens temperature top_p top_k random_seed seed stop_words end_id stream "
                  "exclude_input_in_output return_log_probs ignore_eos num_draft_tokens draft_tree tree_top_k "
                  "tree_depth speculative_method acceptance_method repetition_penalty presence_penalty "
                  "frequency_penalty min_tokens min_length bad_words stop_token_ids guided_decoding_guide_type "
                  "guided_decoding_guide top_logprobs "
                  "prompt_logprobs beam_width num_return_sequences n return_num_input_tokens return_num_output_tokens"),
    _pick(CLIENT, "text_output output_ids output_log_probs cum_log_probs num_steps num_draft_tokens_total "
                  "num_accepted_tokens num_emitted_tokens finish_reason " + _LOGPROBS_OUT +
                  " num_input_tokens num_output_tokens auto_methods auto_num_draft_tokens auto_draft_trees "
                  "auto_tree_top_k"))

MODELS: dict[str, ModelWire] = {
    GENERATE: _GENERATE,
    # the same tensors per row, with max_batch_size 1: [1, ...] on the wire (spec_decode.serving.trtllm_format)
    GENERATE_TRTLLM: _GENERATE,
    "draft_model": ModelWire(
        _pick(STEP, _DRAFT_IN, optional="seeded context_hidden_states num_context_hidden_states logits_processors "
                                        "draft_tree tree_top_k tree_depth",
              ragged="token_ids context_hidden_states"),
        _pick(STEP, "draft_token_ids draft_probs draft_parents")),
    "target_model": ModelWire(
        _pick(STEP, _TARGET_IN, optional="logits_processors num_scheduled_tokens draft_parents",
              ragged="token_ids draft_token_ids draft_parents"),
        _pick(STEP, "target_probs hidden_states log_probs " + _PROMPT_OUT + " target_argmax target_argmax_probs "
              + _TARGET_FACTS)),
    "verifier": ModelWire(
        _pick(STEP, _VERIFIER_IN, optional="logits_processors log_probs seeded target_argmax target_argmax_probs "
                                           "draft_parents",
              ragged="token_ids draft_parents"),
        _pick(STEP, "output_ids output_log_probs output_token_ranks top_log_probs top_log_prob_ids")),
    SPEC_STEP: ModelWire(
        _pick(STEP, "sequence_id token_ids num_draft_tokens speculative_method temperature top_k top_p random_seed "
                    "seeded step release acceptance_method context_hidden_states num_context_hidden_states "
                    "logits_processors num_scheduled_tokens draft_tree tree_top_k tree_depth",
              optional="context_hidden_states num_context_hidden_states logits_processors num_scheduled_tokens "
                       "draft_tree tree_top_k tree_depth"),
        _pick(STEP, "output_ids output_log_probs hidden_states draft_token_ids draft_parents " + _LOGPROBS_OUT + " "
              + _TARGET_FACTS),
        steps=("draft_model", "target_model", "verifier")),
    SCORE_STEP: ModelWire(
        _pick(STEP, "sequence_id token_ids draft_token_ids draft_probs temperature top_k top_p random_seed step "
                    "release acceptance_method logits_processors seeded num_scheduled_tokens draft_parents",
              optional="logits_processors seeded num_scheduled_tokens draft_parents"),
        _pick(STEP, "output_ids output_log_probs hidden_states " + _LOGPROBS_OUT + " " + _TARGET_FACTS),
        steps=("target_model", "verifier")),
    GREEDY_STEP: ModelWire(
        _pick(STEP, "sequence_id token_ids num_draft_tokens speculative_method temperature top_k top_p random_seed "
                    "seeded step release context_hidden_states num_context_hidden_states logits_processors "
                    "num_scheduled_tokens draft_tree tree_top_k tree_depth",
              optional="context_hidden_states num_context_hidden_states logits_processors num_scheduled_tokens "
                       "draft_tree tree_top_k tree_depth"),
        _pick(STEP, "draft_token_ids draft_parents target_argmax target_argmax_probs hidden_states " + _TARGET_FACTS),
        steps=("draft_model", "target_model")),
}

DRAFT_MODEL_INPUTS = MODELS["draft_model"].input_names
TARGET_MODEL_INPUTS = MODELS["target_model"].input_names
VERIFIER_INPUTS = MODELS["verifier"].input_names
GENERATE_INPUTS = MODELS[GENERATE].input_names
GENERATE_OUTPUTS = MODELS[GENERATE].output_names


def ensemble_maps(ensemble: str) -> list[tuple[str, dict[str, str], dict[str, str]]]:
    """Each step of an ensemble as (model, input_map, output_map), by one rule: a step's output keeps its name when it
    is an output of the ensemble, becomes ``_<name>`` (internal) when a later step reads it, and is left unmapped
    otherwise (Triton refuses an ensemble tensor nothing uses); a step's input is fed by the latest earlier step's
    output of that name, else by the ensemble's input of that name.

    Raises:
        KeyError: ``ensemble`` is not an ensemble of :data:`MODELS`, or a step input has no source.
    """
    wire = MODELS[ensemble]
    if not wire.steps:
        raise KeyError(f"{ensemble} is not an ensemble")
    produced: dict[str, str] = {}
    out: list[tuple[str, dict[str, str], dict[str, str]]] = []
    for model in wire.steps:
        step = MODELS[model]
        inputs = {}
        for name in step.input_names:
            if name in produced:
                inputs[name] = produced[name]
            elif name in wire.input_names:
                inputs[name] = name
            else:
                raise KeyError(f"{ensemble}: input {name!r} of {model} has no source")
        later = {n for m in wire.steps[len(out) + 1:] for n in MODELS[m].input_names}
        outputs = {name: name if name in wire.output_names else f"_{name}" for name in step.output_names
                   if name in wire.output_names or name in later}
        produced.update(outputs)
        out.append((model, inputs, outputs))
    return out


_REQUIRED = object()


def scalar(inputs: Mapping, name: str, default=_REQUIRED, tensors: Mapping[str, Tensor] = STEP):
    """The one value of a [1] input, checked against its wire dtype: the scalar decoder of every model.

    Args:
        inputs: input name -> numpy array, or torch tensor for an input left on the GPU.
        name: the input's name in ``tensors``.
        default: returned when the input is absent; without one, an absent input is an error.
        tensors: :data:`STEP` (the step models') or :data:`CLIENT` (generate's).

    Returns:
        The element as numpy delivers it (``np.int64``, ``np.float32``, ``np.bool_``, bytes or str).

    Raises:
        InvalidInputError: a required input that is absent, more than one value, or a dtype of another kind (naming
            the input and what it must be).
    """
    value = inputs.get(name)
    if value is None:
        if default is _REQUIRED:
            raise InvalidInputError(name, f"required ({tensors[name].dtype} [1])")
        return default
    spec = tensors[name]
    arr = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
    what = _WHAT[spec.dtype]
    if arr.size != 1:
        raise InvalidInputError(name, f"expected one {what} value, got shape {list(arr.shape)}")
    if arr.dtype.kind not in _KINDS[spec.dtype]:
        raise InvalidInputError(name, f"expected {what}, got dtype {arr.dtype}")
    return arr.reshape(-1)[0]


def text(inputs: Mapping, name: str, default=_REQUIRED, tensors: Mapping[str, Tensor] = STEP):
    """A STRING [1] input's value decoded as UTF-8 (:func:`scalar`, then :func:`~spec_decode.settings.decode_text`);
    ``default`` (returned as given) when the input is absent.

    Raises:
        InvalidInputError: as :func:`scalar`, or bytes that are not UTF-8 (naming the input).
    """
    if inputs.get(name) is None:
        return scalar(inputs, name, default, tensors)
    return decode_text(scalar(inputs, name, tensors=tensors), name)
