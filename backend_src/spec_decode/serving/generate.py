"""Backend of the decoupled ``generate`` model: tokenise, loop the ``spec_step`` ensemble over BLS, stream.

Each request runs as an asyncio task (the Python backend's async ``execute`` for decoupled models), so several streams
progress concurrently. Their steps run in rounds (:mod:`.rounds`): each round is one batched BLS call to ``spec_step``
(one row per sequence), so concurrent sequences share the draft's and the target's forward passes. Each step's accepted
tokens go to the client as one response (``stream=true``) or are gathered into a single response (``stream=false``, for
HTTP ``/generate``). At the end of a sequence, on errors and on cancellation, a ``release`` call frees the sequence's
caches in every model.
"""

from __future__ import annotations

import asyncio
import logging
import random
import traceback

import numpy as np

from ..loop import Chunk, Generation, StepInputs, StepResult, speculation_disabled
from ..models import load_tokenizer, resolve_model_path
from ..request import METHODS, InvalidInputError, ServerLimits, parse_request
from .adapter import config_param, error_response, read_inputs, stack_rows, strip_padding
from .metrics import Metrics, stats_tuple
from .rounds import StepRounds

logger = logging.getLogger(__name__)

GENERATE_INPUTS = ("text_input", "max_tokens", "temperature", "top_p", "top_k", "random_seed", "stop_words", "end_id",
                   "stream", "exclude_input_in_output", "return_log_probs", "ignore_eos", "num_draft_tokens",
                   "speculative_method", "acceptance_method")
STEP_MODEL = "spec_step"
PLAIN_STEP_MODEL = "score_step"  # target_model -> verifier: a round in which no sequence drafts
STEP_PARTS = ("draft_model", "target_model", "verifier")  # the models the two ensembles run
MAX_PENDING_RELEASES = 256  # failed releases kept to send again (TritonStep.release)


def drafts(inp: StepInputs) -> bool:
    """Whether a step asks draft_model for drafts (k > 0 and a method other than none)."""
    return inp.num_draft_tokens > 0 and inp.method != "none"


class TritonStep:
    """The Triton transport of the generation loop: BLS calls to the ``spec_step`` ensemble.

    A round in which no sequence drafts (speculative_method none, k = 0, speculation disabled) goes to ``score_step``
    instead (target_model -> verifier, the same tensors with empty drafts): draft_model would propose nothing, and its
    hop cost ~1.6 ms per step (measured against spec_step, alternating, on one server). Releases always go through
    ``spec_step``.

    A round of steps (see :mod:`.rounds`) goes as one request whose batch dimension holds one sequence per row, so
    each model of the ensemble gets the whole round in one ``execute`` and draft_model and target_model run it as one
    batched forward. Token-id rows are padded to the longest with ``PAD_ID`` (-1) and so are the outputs' rows.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        model_name: the ensemble to call.
        plain_model_name: the ensemble without draft_model, for rounds without drafts.
        max_batch_size: most sequences per request (the ensemble's max_batch_size); larger rounds are split.
    """

    def __init__(self, pb_utils, model_name: str = STEP_MODEL, max_batch_size: int = 16,
                 plain_model_name: str = PLAIN_STEP_MODEL):
        self.pb = pb_utils
        self.model_name = model_name
        self.plain_model_name = plain_model_name
        self.max_batch_size = max_batch_size
        self._pending_releases: list[StepInputs] = []

    def _request(self, inps: list[StepInputs], release: bool):
        """The BLS request of a round and the ensemble it goes to: ``spec_step``, or ``score_step`` (no draft_model
        hop) when no row drafts. Returns (model name, request)."""
        pb = self.pb
        col = lambda values, dtype: np.array([[v] for v in values], dtype)  # noqa: E731 - [batch, 1]
        params = [i.params for i in inps]
        ids = stack_rows([np.asarray(i.token_ids, np.int64) for i in inps])
        tensors = [
            pb.Tensor("sequence_id", col([i.seq_id for i in inps], np.uint64)),
            pb.Tensor("token_ids", ids),
            pb.Tensor("temperature", col([p.temperature for p in params], np.float32)),
            pb.Tensor("top_k", col([p.top_k for p in params], np.int32)),
            pb.Tensor("top_p", col([p.top_p for p in params], np.float32)),
            pb.Tensor("random_seed", col([p.seed for p in params], np.int64)),
            pb.Tensor("step", col([i.step for i in inps], np.int64)),
            pb.Tensor("release", col([release] * len(inps), np.bool_)),
            pb.Tensor("acceptance_method", col([i.acceptance_method.encode() for i in inps], np.object_)),
        ]
        if release or any(drafts(i) for i in inps):
            model, outputs = self.model_name, ["output_ids", "output_log_probs", "draft_token_ids"]
            tensors += [
                pb.Tensor("num_draft_tokens", col([i.num_draft_tokens for i in inps], np.int32)),
                pb.Tensor("speculative_method", col([i.method.encode() for i in inps], np.object_)),
                pb.Tensor("seeded", col([p.seeded for p in params], np.bool_)),
            ]
        else:
            model, outputs = self.plain_model_name, ["output_ids", "output_log_probs"]
            tensors += [pb.Tensor("draft_token_ids", np.zeros((len(inps), 0), np.int64)),
                        pb.Tensor("draft_probs", np.zeros((len(inps), 0, 0), np.float32))]
        return model, pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs)

    async def _exec(self, inps: list[StepInputs]) -> list[StepResult]:
        model, request = self._request(inps, release=False)
        resp = await request.async_exec()
        if resp.has_error():
            raise RuntimeError(f"{model} failed: {resp.error().message()}{self._unready_parts()}")
        get = self.pb.get_output_tensor_by_name
        ids = get(resp, "output_ids").as_numpy().reshape(len(inps), -1)
        lps = get(resp, "output_log_probs").as_numpy().reshape(len(inps), -1)
        drafted = get(resp, "draft_token_ids")
        drafted = None if drafted is None else drafted.as_numpy().reshape(len(inps), -1)
        out = []
        for row in range(len(inps)):
            n = len(strip_padding(ids[row]))
            k = 0 if drafted is None else len(strip_padding(drafted[row]))
            out.append(StepResult(ids[row, :n].tolist(), k, lps[row, :n].tolist()))
        return out

    def _unready_parts(self) -> str:
        """After a failed step: which step models are not ready (a model whose process died is unloaded and loaded
        again by the launcher, spec_decode/healing.py), as text to append to the error, or ""."""
        is_ready = getattr(self.pb, "is_model_ready", None)  # Triton's model loading API for BLS
        try:
            down = [m for m in STEP_PARTS if is_ready is not None and not is_ready(m)]
        except Exception:  # noqa: BLE001 - the error at hand matters more than this detail
            return ""
        if not down:
            return ""
        return (f" [not ready: {', '.join(down)}; a model whose process died is being loaded again, and the server's "
                f"readiness answers 200 once it is back]")

    async def __call__(self, inp: StepInputs) -> StepResult:
        """Run one sequence's step through the ensemble.

        Raises:
            RuntimeError: the ensemble answered with an error (its message is kept).
        """
        return (await self._exec([inp]))[0]

    async def run_batch(self, inps: list[StepInputs]) -> list:
        """Run several sequences' steps (a round) through the ensemble, ``max_batch_size`` sequences per request.

        Returns:
            per step, its :class:`StepResult` or the exception that fails it. If a batched request fails, its steps
            are run again one by one, so that only the failing sequence fails (steps are idempotent: caches are keyed
            by the token ids, noise by (seed, step, position)).
        """
        chunks = [inps[i:i + self.max_batch_size] for i in range(0, len(inps), self.max_batch_size)]
        out: list = []
        for chunk, res in zip(chunks, await asyncio.gather(*(self._exec(c) for c in chunks), return_exceptions=True)):
            if not isinstance(res, BaseException):
                out += res
            elif len(chunk) == 1:
                out.append(res)
            else:
                logger.warning("a batched step failed (%s); running its %d sequences one by one", res, len(chunk))
                solo = await asyncio.gather(*(self(i) for i in chunk), return_exceptions=True)
                # A model process that died fails the round with "Stub process '<instance>' is not healthy"; by the
                # time the steps run alone its model may be reloading ("... is not ready"): name the first cause.
                out += [RuntimeError(f"{res} (then, run alone: {r})")
                        if isinstance(r, BaseException) and str(r) != str(res) else r for r in solo]
        return out

    async def release(self, gen: Generation) -> None:
        """Free the sequence's caches in every model of the ensemble; then send again earlier releases that failed.

        A release fails while a model of the ensemble is being loaded again (its process died): the other models then
        still hold the sequence's caches. Such a release (one that failed while a step model was not ready) is kept,
        the newest ``MAX_PENDING_RELEASES`` (the models' LRU bound covers the rest), and sent again, in requests of
        its own, after the next release that succeeds. A release that fails otherwise is logged and dropped, as
        before. Errors are logged, not raised.
        """
        try:
            inp = gen.next_step()
        except Exception:  # noqa: BLE001
            logger.warning("release of sequence %d failed: %s", gen.seq_id, traceback.format_exc())
            return
        pending, self._pending_releases = self._pending_releases, []
        kept = await self._send_releases([inp])
        if pending and not kept:  # the ensemble is back: send the earlier failures
            kept = await self._send_releases(pending)
        else:
            kept += pending
        self._pending_releases = (self._pending_releases + kept)[-MAX_PENDING_RELEASES:]

    async def _send_releases(self, inps: list[StepInputs]) -> list[StepInputs]:
        """Send releases, ``max_batch_size`` per request; returns those that failed while a step model was not ready."""
        kept = []
        for i in range(0, len(inps), self.max_batch_size):
            chunk = inps[i:i + self.max_batch_size]
            try:
                resp = await self._request(chunk, release=True)[1].async_exec()
                error = resp.error().message() if resp.has_error() else None
            except Exception:  # noqa: BLE001
                error = traceback.format_exc()
            if error is None:
                continue
            unready = self._unready_parts()
            if unready:
                kept += chunk
            logger.warning("release of sequences %s failed%s: %s%s", [x.seq_id for x in chunk],
                           " (sent again after the next release)" if unready else "", error, unready)
        return kept


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
        # Steps of concurrent sequences start together so that they share forward passes (see rounds.py).
        self.rounds = StepRounds(self._run_round, max_wait_s=config_param(params, "step_round_max_wait_ms", 20) / 1000)
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
                "text_input",
                f"prompt is {len(prompt_ids)} tokens; must be below max_model_len={self.limits.max_model_len}",
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
            self.rounds.join()
            try:
                while not gen.finished:
                    if sender.is_cancelled():
                        gen.cancel()
                        break
                    inp = gen.next_step()
                    if speculation_disabled(self.running, self.disable_by_batch_size):
                        inp.num_draft_tokens = 0
                    result = await self.rounds.submit(inp)
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
            finally:  # the other sequences' rounds need not wait for this one any more
                self.rounds.leave()
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
            self.metrics.add("spec_decode_requests_total", 1, method=req.speculative_method,
                             finish_reason=gen.finish_reason or "error")
            self._set_running(-1)

    async def _run_round(self, inps: list[StepInputs]) -> list:
        """One round of steps (:class:`StepRounds`): one batched request when the transport has ``run_batch``."""
        run_batch = getattr(self.step, "run_batch", None)
        if run_batch is not None:
            return await run_batch(inps)
        return await asyncio.gather(*(self.step(i) for i in inps), return_exceptions=True)

    def _set_running(self, delta: int) -> None:
        self.running += delta
        self.metrics.set("spec_decode_running_sequences", self.running)
        self.metrics.flush()  # a request started or ended: Prometheus sees it at once
