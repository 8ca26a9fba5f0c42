"""Backend of the decoupled ``generate`` model: tokenise, loop the ``spec_step`` ensemble over BLS, stream.

Each request runs as an asyncio task (the Python backend's async ``execute`` for decoupled models), so several streams
progress concurrently. Each step is one BLS call to ``spec_step``; each step's accepted tokens go to the client as one
response (``stream=true``) or are gathered into a single response (``stream=false``, for HTTP ``/generate``). At the end
of a sequence, on errors and on cancellation, a ``release`` call frees the sequence's caches in every model.
"""

from __future__ import annotations

import logging
import random
import traceback

import numpy as np

from ..loop import Chunk, Generation, StepInputs, StepResult, speculation_disabled
from ..models import load_tokenizer, resolve_model_path
from ..request import METHODS, InvalidInputError, ServerLimits, parse_request
from .adapter import config_param, error_response, read_inputs
from .metrics import Metrics, stats_tuple

logger = logging.getLogger(__name__)

GENERATE_INPUTS = ("text_input", "max_tokens", "temperature", "top_p", "top_k", "random_seed", "stop_words", "end_id",
                   "stream", "exclude_input_in_output", "return_log_probs", "ignore_eos", "num_draft_tokens",
                   "speculative_method", "acceptance_method")
STEP_MODEL = "spec_step"


class TritonStep:
    """The Triton transport of the generation loop: one BLS call to the ``spec_step`` ensemble per step.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        model_name: the ensemble to call.
    """

    def __init__(self, pb_utils, model_name: str = STEP_MODEL):
        self.pb = pb_utils
        self.model_name = model_name

    def _request(self, inp: StepInputs, release: bool):
        pb, p = self.pb, inp.params
        one = lambda value, dtype: np.array([[value]], dtype)  # noqa: E731 - batch dimension 1, one element
        tensors = [
            pb.Tensor("sequence_id", one(inp.seq_id, np.uint64)),
            pb.Tensor("token_ids", np.asarray(inp.token_ids, np.int64)[None]),
            pb.Tensor("num_draft_tokens", one(inp.num_draft_tokens, np.int32)),
            pb.Tensor("speculative_method", one(inp.method.encode(), np.object_)),
            pb.Tensor("temperature", one(p.temperature, np.float32)),
            pb.Tensor("top_k", one(p.top_k, np.int32)),
            pb.Tensor("top_p", one(p.top_p, np.float32)),
            pb.Tensor("random_seed", one(p.seed, np.int64)),
            pb.Tensor("seeded", one(p.seeded, np.bool_)),
            pb.Tensor("step", one(inp.step, np.int64)),
            pb.Tensor("release", one(release, np.bool_)),
            pb.Tensor("acceptance_method", one(inp.acceptance_method.encode(), np.object_)),
        ]
        return pb.InferenceRequest(
            model_name=self.model_name,
            inputs=tensors,
            requested_output_names=["output_ids", "output_log_probs", "draft_token_ids"],
        )

    async def __call__(self, inp: StepInputs) -> StepResult:
        """Run one step through the ensemble.

        Raises:
            RuntimeError: the ensemble answered with an error (its message is kept).
        """
        resp = await self._request(inp, release=False).async_exec()
        if resp.has_error():
            raise RuntimeError(f"spec_step failed: {resp.error().message()}")
        get = self.pb.get_output_tensor_by_name
        ids = get(resp, "output_ids").as_numpy().reshape(-1).tolist()
        lps = get(resp, "output_log_probs").as_numpy().reshape(-1).tolist()
        drafted = int(get(resp, "draft_token_ids").as_numpy().size)
        return StepResult(ids, drafted, lps)

    async def release(self, gen: Generation) -> None:
        """Free the sequence's caches in every model of the ensemble (errors are logged, not raised)."""
        try:
            inp = gen.next_step()
            resp = await self._request(inp, release=True).async_exec()
            if resp.has_error():
                logger.warning("release of sequence %d failed: %s", gen.seq_id, resp.error().message())
        except Exception:  # noqa: BLE001
            logger.warning("release of sequence %d failed: %s", gen.seq_id, traceback.format_exc())


class GenerateBackend:
    """The ``generate`` model's logic.

    Config parameters: tokenizer_path ("default" = the embedded target's), default_speculative_method,
    num_draft_tokens, max_num_draft_tokens, max_model_len, draft_model_available ("true" when draft_model has a draft
    LM, which enables speculative_method=draft; "auto" = when the distilled default draft exists, matching
    draft_model_path "auto"), num_draft_tokens_schedule ("constant", or "heuristic": k adapts to
    acceptance between 1 and max_num_draft_tokens as in transformers), disable_by_batch_size (0 = never; else steps run
    with k = 0 while at
    least this many requests are running).
    """

    def __init__(self, params: dict[str, str], pb_utils):
        self.pb = pb_utils
        self.tokenizer = load_tokenizer(resolve_model_path(config_param(params, "tokenizer_path", "default")))
        available = config_param(params, "draft_model_available", "auto")
        if available == "auto":  # as draft_model_path "auto": the distilled default draft, when built
            from ..models import default_draft_ready

            available = "true" if default_draft_ready() else "false"
        methods = tuple(m for m in METHODS if m != "draft" or available == "true")
        default_method = config_param(params, "default_speculative_method", "suffix")
        if default_method not in methods:
            raise ValueError(f"default_speculative_method={default_method!r}: allowed values are {', '.join(methods)}")
        self.limits = ServerLimits(
            default_method=default_method,
            default_num_draft_tokens=config_param(params, "num_draft_tokens", 4),
            max_num_draft_tokens=config_param(params, "max_num_draft_tokens", 8),
            max_model_len=config_param(params, "max_model_len", 2048),
            methods=methods,
        )
        self.eos_ids = {self.tokenizer.eos_token_id} - {None}
        self.step = TritonStep(pb_utils)
        self.disable_by_batch_size = config_param(params, "disable_by_batch_size", 0)
        schedule = config_param(params, "num_draft_tokens_schedule", "constant")
        if schedule not in ("constant", "heuristic"):
            raise ValueError(f"num_draft_tokens_schedule={schedule!r}: allowed values are constant, heuristic")
        self.adaptive_max_k = self.limits.max_num_draft_tokens if schedule == "heuristic" else 0
        self.running = 0  # requests being generated (this instance)
        self._rng = random.Random()
        self.metrics = Metrics(pb_utils)
        self.metrics.set("spec_decode_running_sequences", 0)

    def _start(self, inputs: dict) -> Generation:
        req = parse_request(inputs, self.limits)
        vocab = len(self.tokenizer)
        if req.end_id is not None and not 0 <= req.end_id < vocab:
            raise InvalidInputError("end_id", f"must be a token id in [0, {vocab}), got {req.end_id}")
        prompt_ids = self.tokenizer(req.text_input)["input_ids"]
        if len(prompt_ids) >= self.limits.max_model_len:
            raise InvalidInputError(
                "text_input", f"prompt is {len(prompt_ids)} tokens; must be below max_model_len={self.limits.max_model_len}"
            )
        seed = req.random_seed if req.random_seed is not None else self._rng.getrandbits(63)
        seq_id = self._rng.getrandbits(63)
        return Generation(seq_id, prompt_ids, req, self.tokenizer, self.eos_ids, self.limits.max_model_len, seed,
                          adaptive_max_num_draft_tokens=self.adaptive_max_k)

    def _response(self, gen: Generation, chunk: Chunk, prefix: str = ""):
        pb = self.pb
        out = [
            pb.Tensor("text_output", np.array([(prefix + chunk.text).encode("utf-8")], np.object_)),
            pb.Tensor("output_ids", np.asarray(chunk.token_ids, np.int32)),
        ]
        if gen.request.return_log_probs:
            out.append(pb.Tensor("output_log_probs", np.asarray(chunk.log_probs, np.float32)))
        if chunk.finished:
            s = gen.stats
            if gen.request.return_log_probs:
                out.append(pb.Tensor("cum_log_probs", np.array([gen.cum_log_prob], np.float32)))
            out += [
                pb.Tensor("num_steps", np.array([s.steps], np.int32)),
                pb.Tensor("num_draft_tokens_total", np.array([s.draft_tokens], np.int32)),
                pb.Tensor("num_accepted_tokens", np.array([s.accepted_tokens], np.int32)),
                pb.Tensor("num_emitted_tokens", np.array([s.emitted_tokens], np.int32)),
                pb.Tensor("finish_reason", np.array([(chunk.finish_reason or "").encode()], np.object_)),
            ]
        return pb.InferenceResponse(output_tensors=out)

    async def handle(self, request) -> None:
        """Serve one request to completion: every response goes through the request's response sender."""
        pb = self.pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            gen = self._start(read_inputs(request, GENERATE_INPUTS, pb))
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, ValueError):
                logger.error("generate: %s", traceback.format_exc())
            sender.send(error_response(exc, pb), flags=final)
            return
        req = gen.request
        gathered_text, gathered_ids, gathered_lps = [], [], []
        self._set_running(+1)
        try:
            while not gen.finished:
                if sender.is_cancelled():
                    gen.cancel()
                    break
                inp = gen.next_step()
                if speculation_disabled(self.running, self.disable_by_batch_size):
                    inp.num_draft_tokens = 0
                result = await self.step(inp)
                if sender.is_cancelled():  # the client left during the step: send and count nothing more
                    gen.cancel()
                    break
                before = stats_tuple(gen.stats)
                chunk = gen.commit(result)
                self.metrics.record_step(req.speculative_method, inp.num_draft_tokens, before, gen.stats)
                if req.stream:
                    if chunk.finished:
                        break
                    if chunk.token_ids or chunk.text:
                        sender.send(self._response(gen, chunk))
                else:
                    gathered_text.append(chunk.text)
                    gathered_ids += chunk.token_ids
                    gathered_lps += chunk.log_probs
            if gen.finish_reason == "cancelled":
                # The client is gone: close the stream without data.
                sender.send(flags=final)
            elif req.stream:
                sender.send(self._response(gen, chunk), flags=final)
            else:
                whole = Chunk("".join(gathered_text), gathered_ids, gathered_lps, True, gen.finish_reason)
                prefix = "" if req.exclude_input_in_output else req.text_input
                sender.send(self._response(gen, whole, prefix), flags=final)
        except Exception as exc:  # noqa: BLE001
            logger.error("generate: %s", traceback.format_exc())
            gen.finish_reason = "error"
            try:
                sender.send(error_response(exc, pb), flags=final)
            except Exception:  # noqa: BLE001 - the stream may already be closed
                pass
        finally:
            await self.step.release(gen)
            self._set_running(-1)
            self.metrics.add("spec_decode_requests_total", 1, method=req.speculative_method,
                             finish_reason=gen.finish_reason or "error")

    def _set_running(self, delta: int) -> None:
        self.running += delta
        self.metrics.set("spec_decode_running_sequences", self.running)
