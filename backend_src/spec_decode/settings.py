"""Settings of the served models and the input rules they share with requests: every rule and default in one place.

- Config settings (docs/configuration.md): one frozen dataclass per model of the repository (:class:`TargetSettings`,
  :class:`DraftModelSettings`, :class:`GenerateSettings` here; the verifier's
  :class:`~spec_decode.verifier.VerifierSettings`) and one per proposer (its ``Settings``, in its own file under
  :mod:`spec_decode.proposers`), built once when the model loads from the ``parameters`` of its config.pbtxt
  (:meth:`ConfigSettings.from_params`). A field's default is the parameter's default; the shipped config.pbtxt files
  list the same values (``tests/unit/test_settings.py`` holds them to it).
- Input rules: :class:`InvalidInputError` and the checks (:func:`one_of`, :func:`in_range`,
  :func:`check_acceptance_method`) that generate's request parsing (:mod:`spec_decode.serving.generate_inputs`), the
  step models' input decoding (:mod:`spec_decode.serving.step_inputs`), the sampling parameters
  (:class:`spec_decode.sampling.SamplingParams`) and the settings call. What they have checked, the code behind them
  trusts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

from .scheduler.k_schedule import K_SCHEDULES

logger = logging.getLogger(__name__)

ACCEPTANCE_METHODS = ("rejection", "typical")


class InvalidInputError(ValueError):
    """An input is missing or out of range; the message names the field and what is allowed.

    Attributes:
        field: the input's name (a request tensor, a step model input, or a config.pbtxt parameter).
        detail: what is wrong and what is allowed (the message without the field's name).
    """

    def __init__(self, field_name: str, detail: str):
        super().__init__(f"invalid input '{field_name}': {detail}")
        self.field = field_name
        self.detail = detail


def one_of(field_name: str, value: str, allowed: Sequence[str], note: str = "") -> str:
    """``value`` stripped and lower-cased, when it is one of ``allowed``.

    Raises:
        InvalidInputError: naming ``field_name`` and the allowed values (then ``note``).
    """
    v = str(value).strip().lower()
    if v not in allowed:
        raise InvalidInputError(field_name, f"{v!r} is not one of {', '.join(allowed)}{note}")
    return v


def in_range(field_name: str, value, low, high=None, note: str = ""):
    """``value`` when ``low <= value <= high`` (``high`` None: no upper bound); NaN and infinities never are.

    Raises:
        InvalidInputError: naming ``field_name`` and the range (then ``note``).
    """
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bound = f"must be >= {low}" if high is None else f"must be in [{low}, {high}]"
        raise InvalidInputError(field_name, f"{bound}{note}, got {value}")
    return value


def check_acceptance_method(field_name: str, value: str) -> str:
    """An acceptance method: ``rejection`` (lossless) or ``typical`` (not lossless).

    Raises:
        InvalidInputError: naming ``field_name`` and the allowed values.
    """
    return one_of(field_name, value, ACCEPTANCE_METHODS, " (typical is not lossless)")


def decode_text(value, field_name: str) -> str:
    """A STRING (BYTES) input's value as text.

    Raises:
        InvalidInputError: bytes that are not valid UTF-8, or a value that is not a string.
    """
    if isinstance(value, bytes):  # numpy's bytes_ too
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInputError(field_name, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise InvalidInputError(field_name, f"expected a UTF-8 string (BYTES), got {type(value).__name__}")


def _convert(key: str, raw: str, default):
    """A config value (a string) as the type of ``default``."""
    if isinstance(default, bool):
        v = raw.lower()
        if v in ("true", "1", "yes"):
            return True
        if v in ("false", "0", "no"):
            return False
        raise ValueError(f"config parameter {key!r}: expected true or false, got {raw!r}")
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"config parameter {key!r}: expected {type(default).__name__}, got {raw!r}") from None


@dataclass(frozen=True)
class ConfigSettings:
    """Base of the typed settings built from a model's config.pbtxt ``parameters``.

    A subclass is a frozen dataclass whose fields all have defaults (int, float, bool or str); the config parameter of
    field ``f`` is ``PREFIX + f``. :meth:`check` (called at construction) raises :class:`InvalidInputError` for a value
    out of range; the error is re-raised as a ``ValueError`` naming the config parameter.

    Class attributes:
        PREFIX: prepended to every field's name to make its parameter key (e.g. ``"ngram_"``: ``ngram_min``).

    Raises:
        ValueError: (construction) a value out of range, naming the config parameter and what is allowed.
    """

    PREFIX: ClassVar[str] = ""

    def __post_init__(self):
        try:
            self.check()
        except InvalidInputError as e:
            raise ValueError(f"config parameter {self.PREFIX + e.field!r}: {e.detail}") from None

    def check(self) -> None:
        """Raise :class:`InvalidInputError` (field name, what is allowed) for a value out of range."""

    def _choice(self, name: str, allowed: Sequence[str], note: str = "") -> None:
        """Check that field ``name`` is one of ``allowed`` (:func:`one_of`) and keep it stripped and lower-cased."""
        object.__setattr__(self, name, one_of(name, getattr(self, name), allowed, note))

    @classmethod
    def parameter_names(cls) -> tuple[str, ...]:
        """The config.pbtxt parameter keys of these settings."""
        return tuple(cls.PREFIX + f.name for f in fields(cls))

    @classmethod
    def from_params(cls, params: Mapping[str, str]):
        """The settings from a model's config parameters (key -> string value; absent keys take the defaults).

        An empty value means the default for numbers and booleans; a string setting keeps it (``draft_model_path:
        ""`` means no draft LM).

        Raises:
            ValueError: naming the parameter, when a value does not convert or is out of range.
        """
        values = {}
        for f in fields(cls):
            key = cls.PREFIX + f.name
            if key not in params:
                continue
            raw = str(params[key]).strip()
            if raw or isinstance(f.default, str):
                try:
                    values[f.name] = _convert(key, raw, f.default)
                except ValueError as e:
                    allowed = cls._allowed(f.name)
                    raise ValueError(f"{e}{'; ' + allowed if allowed else ''}") from None
        return cls(**values)

    @classmethod
    def _allowed(cls, name: str) -> str:
        """What :meth:`check` allows for the number field ``name`` (its range, as its error says it: "must be in [1,
        10]"), found by checking the defaults with NaN there (no range holds NaN); "" when it says nothing."""
        default = next(f.default for f in fields(cls) if f.name == name)
        if isinstance(default, (bool, str)):
            return ""
        probe = object.__new__(cls)
        for f in fields(cls):
            object.__setattr__(probe, f.name, math.nan if f.name == name else f.default)
        try:
            probe.check()
        except InvalidInputError as e:
            if e.field == name:
                return e.detail.rsplit(", got ", 1)[0]
        except (TypeError, ValueError):
            pass
        return ""


def warn_unknown_parameters(model: str, params: Mapping[str, str], known: set[str]) -> None:
    """Log a warning for each config parameter of ``model`` that no setting reads (a typo keeps the default).

    Upper-case keys are the Python backend's own (``FORCE_CPU_ONLY_INPUT_TENSORS``, ``EXECUTION_ENV_PATH``).
    """
    for key in sorted(set(params) - known):
        if not key.isupper():
            logger.warning("%s: config parameter %r is not a setting of this model (known: %s); it is ignored", model,
                           key, ", ".join(sorted(known)))


DEVICE_HELP = "auto, cpu, cuda or cuda:N"


@dataclass(frozen=True)
class LMSettings(ConfigSettings):
    """Where a causal LM runs and how many KV caches it keeps (target_model, and draft_model's draft LM).

    Attributes:
        device: ``auto`` (an instance of kind KIND_GPU: its GPU; otherwise cuda when available), ``cpu``, ``cuda``,
            ``cuda:N``.
        dtype: ``auto`` (bfloat16 on CUDA and on a CPU that multiplies it natively with batch-invariant kernels, else
            float32: :func:`spec_decode.engine.dtype_choice.choose_dtype`), ``float32``, ``float16``, ``bfloat16``.
        max_sequences: KV caches of running sequences kept (LRU), >= 1; as many released ones are kept for prefix
            reuse.
        kv_cache_max_tokens: the positions of the paged KV pool (running sequences and released ones' pages kept for
            prefix reuse), >= 1024, or 0: sized from the device's memory (CUDA: ``gpu_memory_utilization``; CPU: a
            quarter of the machine's). Memory: this x 2 x layers x KV heads x head dim x the dtype's bytes (46 KiB per
            token for the embedded SmolLM2-135M in float32, ~2.9 GiB at the default), allocated at load (on a CPU
            mapped as it is first written).
        enable_prefix_caching: share the KV of full 16-token pages across sequences with the same leading tokens
            (vLLM's automatic prefix caching; :mod:`spec_decode.engine.kv_cache`).
        cuda_graphs: ``auto`` (on CUDA, capture the forward of each round shape at load and replay it; a failed
            capture is logged and every round runs eagerly), ``on`` (the same, but a failed capture fails the load,
            naming the shape and the exception), ``emulate`` (on any device, each round a graph would replay runs
            eagerly at the captured shape, padded rows and pages included: the captured path's code on a CPU, for
            tests) or ``off``.
        gpu_memory_utilization: on CUDA, the fraction of the GPU's memory that this process's weights, KV pool and
            everything in use before it may fill (vLLM's setting), in (0, 1].
    """

    device: str = "auto"
    dtype: str = "auto"
    max_sequences: int = 64
    kv_cache_max_tokens: int = 65536
    enable_prefix_caching: bool = True
    cuda_graphs: str = "auto"
    gpu_memory_utilization: float = 0.9

    DTYPES: ClassVar[tuple[str, ...]] = ("auto", "float32", "float16", "bfloat16")
    MIN_KV_CACHE_TOKENS: ClassVar[int] = 1024  # the smallest kv_cache_max_tokens (and pool sized from memory)

    def check(self) -> None:
        """dtype one of :attr:`DTYPES`, max_sequences >= 1, kv_cache_max_tokens 0 or >= 1024, cuda_graphs auto,
        on, emulate or off, gpu_memory_utilization in (0, 1], device one of auto, cpu, cuda, cuda:N (kept
        lower-cased)."""
        self._choice("dtype", self.DTYPES)
        self._choice("cuda_graphs", ("auto", "on", "emulate", "off"))
        in_range("max_sequences", self.max_sequences, 1)
        if self.kv_cache_max_tokens != 0:
            in_range("kv_cache_max_tokens", self.kv_cache_max_tokens, self.MIN_KV_CACHE_TOKENS, None,
                     " (0 = from the device's memory)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidInputError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        d = self.device.strip().lower()
        if not (d in ("auto", "cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            raise InvalidInputError("device", f"{self.device!r} is not one of {DEVICE_HELP}")
        object.__setattr__(self, "device", d)


@dataclass(frozen=True)
class TargetSettings(LMSettings):
    """target_model's settings.

    Attributes:
        model_path: a Hugging Face causal-LM folder, or ``default`` (the embedded SmolLM2-135M-Instruct).
        logprobs_mode: which log-probs requests get (vLLM's ``logprobs_mode``): ``raw`` (the target's log-softmax
            before any processor, temperature, top-k or top-p; vLLM's default) or ``processed`` (the log of the
            distribution each token was sampled from).
        aux_hidden_state_layers: the decoder layers whose inputs the ``hidden_states`` output carries after the last
            hidden state (what EAGLE-3 heads read): ``auto`` (those the heads of draft_model's ``speculator_path``
            name), ``none``, or layer ids separated by commas.
    """

    model_path: str = "default"
    logprobs_mode: str = "raw"
    aux_hidden_state_layers: str = "auto"

    def check(self) -> None:
        """As :meth:`LMSettings.check`, model_path not blank, logprobs_mode ``raw`` or ``processed``."""
        super().check()
        if not self.model_path.strip():
            raise InvalidInputError("model_path", "must name a model folder or 'default'")
        self._choice("logprobs_mode", ("raw", "processed"))
        value = self.aux_hidden_state_layers.strip().lower()
        if value not in ("auto", "none", "") and not all(x.strip().isdigit() for x in value.split(",")):
            raise InvalidInputError("aux_hidden_state_layers", f"{self.aux_hidden_state_layers!r} is not auto, none "
                                                               f"or layer ids separated by commas")


@dataclass(frozen=True)
class DraftModelSettings(ConfigSettings):
    """draft_model's own settings (each proposer's are its ``Settings``: :mod:`spec_decode.proposers.registry`).

    Attributes:
        max_num_draft_tokens: the largest k a step may ask for, direct calls to spec_step included (>= 1; generate's
            own ``max_num_draft_tokens`` bounds its clients' requests).
        tokenizer_path: the target's tokenizer folder, or ``default`` (the embedded target's): model proposers (the
            draft LM, the EAGLE head) keep structured output's grammar state over it.
    """

    max_num_draft_tokens: int = 16
    tokenizer_path: str = "default"

    def check(self) -> None:
        """max_num_draft_tokens >= 1."""
        in_range("max_num_draft_tokens", self.max_num_draft_tokens, 1)


@dataclass(frozen=True)
class GenerateSettings(ConfigSettings):
    """generate's settings: the server's defaults and bounds for requests.

    Attributes:
        tokenizer_path: the target's tokenizer folder, or ``default`` (the embedded target's).
        default_speculative_method: the method of a request that names none (must be one the server serves).
        num_draft_tokens: the k of a request that sends none, in [0, max_num_draft_tokens].
        max_num_draft_tokens: the largest k a request may ask for (>= 1; at most draft_model's own bound).
        max_model_len: prompt + output tokens must fit in this many positions (>= 2).
        draft_model_available: ``auto`` (whether the draft distilled by ``make draft`` exists, as draft_model's
            ``draft_model_path: auto``), ``true`` (draft_model serves a draft LM: speculative_method ``draft`` is
            offered) or ``false``.
        num_draft_tokens_schedule: ``constant`` or ``heuristic`` (:mod:`spec_decode.scheduler.k_schedule`; a proposer
            may replace it with its own).
        disable_by_batch_size: while at least this many requests run, steps run without speculation (0 = never).
        step_round_max_wait_ms: a round of steps starts when every running sequence has submitted its step, or this
            many milliseconds after the first did (> 0).
        max_num_batched_tokens: each round's budget of new target positions, shared by the running sequences' steps
            (k + 1 each) and chunks of new prompts (:mod:`spec_decode.scheduler.chunked_prefill`; vLLM's name); 0 = no
            budget (a prompt is prefilled in one piece inside its first round), else >= 32.
        draft_tree: a request that sends no ``draft_tree`` lets its proposer draft a tree of up to
            ``num_draft_tokens`` nodes (:mod:`spec_decode.tree`; proposers that make chains keep making chains);
            ``false``: chains.
    """

    tokenizer_path: str = "default"
    default_speculative_method: str = "suffix"
    num_draft_tokens: int = 4
    max_num_draft_tokens: int = 8
    max_model_len: int = 2048
    draft_model_available: str = "auto"
    num_draft_tokens_schedule: str = "constant"
    disable_by_batch_size: int = 0
    step_round_max_wait_ms: float = 20.0
    max_num_batched_tokens: int = 192
    draft_tree: bool = True

    def check(self) -> None:
        """max_num_draft_tokens >= 1, num_draft_tokens in [0, max_num_draft_tokens], max_model_len >= 2, the two
        choices among their values, disable_by_batch_size >= 0, step_round_max_wait_ms > 0, max_num_batched_tokens 0 or
        >= 32."""
        in_range("max_num_draft_tokens", self.max_num_draft_tokens, 1)
        in_range("num_draft_tokens", self.num_draft_tokens, 0, self.max_num_draft_tokens)
        in_range("max_model_len", self.max_model_len, 2)
        self._choice("draft_model_available", ("auto", "true", "false"))
        self._choice("num_draft_tokens_schedule", K_SCHEDULES)
        in_range("disable_by_batch_size", self.disable_by_batch_size, 0)
        if self.max_num_batched_tokens != 0:
            in_range("max_num_batched_tokens", self.max_num_batched_tokens, 32, None, " (0 = no budget)")
        if not self.step_round_max_wait_ms > 0:
            raise InvalidInputError("step_round_max_wait_ms", f"must be > 0, got {self.step_round_max_wait_ms}")
