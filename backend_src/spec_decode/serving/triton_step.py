"""The Triton transport of the generation loop: BLS calls from ``generate`` to the ``spec_step`` ensemble.

A round of steps (:mod:`.rounds`) goes as one request whose batch dimension holds one sequence per row, so each model
of the ensemble gets the whole round in one ``execute``. A round in which no sequence drafts goes to ``score_step``
(target_model -> verifier) instead. A round whose rows are all greedy without log-probs skips the verifier: it goes
to ``greedy_step`` (draft_model -> target_model), or to target_model alone when no row drafts, and the argmax walk
the verifier would run is run here (:func:`~spec_decode.verifier.argmax_walk`). Releases free a finished sequence's
caches in every model.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback

import numpy as np
import torch

from ..generation import Generation
from ..protocol import StepInputs, StepResult
from ..verifier import argmax_suffices, argmax_walk
from .adapter import strip_padding
from .round_codec import LOGPROB_OUTPUTS, TARGET_FACTS, RoundDrafts, decode_results, encode_round
from .step_inputs import needs_hidden_states
from .wire import GREEDY_STEP, MODELS, PROMPT_LOGPROB_OUTPUTS, SCORE_STEP, SPEC_STEP, STEP_PARTS

logger = logging.getLogger(__name__)

MAX_PENDING_RELEASES = 256  # failed releases kept to send again (TritonStep.release)


def _argmax_only(inp: StepInputs) -> bool:
    """Whether a step's result follows from the target's argmax alone: greedy, and no log-probs asked (of its tokens
    or, on a first step, of its prompt). A round of such steps needs no verifier."""
    return argmax_suffices(inp.params, inp.processors) and not inp.wants_prompt_logprobs


def _host_array(tensor) -> np.ndarray | None:
    """An output tensor of a BLS response as a host numpy array (a GPU one through DLPack), or None when absent."""
    if tensor is None:
        return None
    if tensor.is_cpu():
        return tensor.as_numpy()
    x = torch.from_dlpack(tensor.to_dlpack())
    return (x.float() if x.is_floating_point() else x).cpu().numpy()


class TritonStep:
    """The Triton transport of the generation loop: BLS calls to the ``spec_step`` ensemble.

    A round in which no sequence drafts (speculative_method none, k = 0, speculation disabled) goes to ``score_step``
    instead (target_model -> verifier, the same tensors with empty drafts), which saves draft_model's hop
    (docs/benchmarks.md has its cost). A round whose rows are all greedy without log-probs goes to ``greedy_step``
    (draft_model -> target_model), or to ``target_model`` alone when no row drafts: target_model sends those rows'
    argmax (``target_argmax``, ``target_argmax_probs``) and the argmax walk the verifier would run is run here
    (:func:`~spec_decode.verifier.argmax_walk`: the same ids and log-probs), which saves the verifier's hop.
    Releases always go through ``spec_step``.

    A round of steps (see :mod:`.rounds`) goes as one request whose batch dimension holds one sequence per row, so
    each model of the ensemble gets the whole round in one ``execute`` and draft_model and target_model run it as one
    batched forward. Token-id rows are padded to the longest with ``PAD_ID`` (-1) and so are the outputs' rows.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        model_name: the ensemble to call.
        plain_model_name: the ensemble without draft_model, for rounds without drafts.
        greedy_model_name: the ensemble without the verifier, for greedy rounds without log-probs.
        target_model_name: the target scorer, for greedy rounds without drafts or log-probs.
        max_batch_size: most sequences per request (the ensemble's max_batch_size); larger rounds are split.

    Attributes:
        stage_seconds: seconds spent since load by stage (``build_request``, ``ensemble``: awaiting the BLS call,
            ``parse_response``), summed over requests (a round split in several requests overlaps in ``ensemble``).
    """

    def __init__(self, pb_utils, model_name: str = SPEC_STEP, max_batch_size: int = 16,
                 plain_model_name: str = SCORE_STEP, greedy_model_name: str = GREEDY_STEP,
                 target_model_name: str = "target_model"):
        self.pb = pb_utils
        self.model_name = model_name
        self.plain_model_name = plain_model_name
        self.greedy_model_name = greedy_model_name
        self.target_model_name = target_model_name
        self.max_batch_size = max_batch_size
        self._pending_releases: list[StepInputs] = []
        self.stage_seconds = {"build_request": 0.0, "ensemble": 0.0, "parse_response": 0.0}

    def _request(self, inps: list[StepInputs], release: bool):
        """The BLS request of a round and the model it goes to: ``spec_step``, or ``score_step`` (no draft_model
        hop) when no row drafts (:func:`~.round_codec.encode_round`); when every row's result follows from its
        argmax (:func:`_argmax_only`), ``greedy_step`` and ``target_model`` instead (no verifier hop), with the inputs
        those declare. Returns (model name, request)."""
        inputs = encode_round(inps, release)
        drafts = "num_draft_tokens" in inputs
        if not release and all(_argmax_only(i) for i in inps):
            model = self.greedy_model_name if drafts else self.target_model_name
            outputs = ["target_argmax", "target_argmax_probs"]
            outputs += ["draft_token_ids", "draft_parents"] if drafts else []
        elif drafts:
            model, outputs = self.model_name, ["output_ids", "output_log_probs", "draft_token_ids", "draft_parents"]
        else:
            model, outputs = self.plain_model_name, ["output_ids", "output_log_probs"]
        if model in MODELS:  # only what the model declares (greedy_step and target_model take fewer inputs)
            inputs = {name: value for name, value in inputs.items() if name in MODELS[model].input_names}
        if not release:
            outputs += list(TARGET_FACTS)
        if not release and any(needs_hidden_states(i.method) for i in inps):  # only then: a tensor less per step
            outputs.append("hidden_states")
        if not release and any(i.processors is not None and i.processors.logprobs for i in inps):
            outputs += ["output_token_ranks", "top_log_probs", "top_log_prob_ids"]
        if not release and any(i.wants_prompt_logprobs for i in inps):
            outputs += list(PROMPT_LOGPROB_OUTPUTS)
        tensors = [self.pb.Tensor(name, value) for name, value in inputs.items()]
        return model, self.pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs)

    async def _exec(self, inps: list[StepInputs]) -> list[StepResult]:
        """One round's request (:meth:`_request`) and its outputs per row, without padding.

        Raises:
            RuntimeError: the ensemble answered with an error (its message, and which step models are not ready).
        """
        t0 = time.perf_counter()
        model, request = self._request(inps, release=False)
        t1 = time.perf_counter()
        resp = await request.async_exec()
        t2 = time.perf_counter()
        self.stage_seconds["build_request"] += t1 - t0
        self.stage_seconds["ensemble"] += t2 - t1
        if resp.has_error():
            raise RuntimeError(f"{model} failed: {resp.error().message()}{self._unready_parts()}")
        get = self.pb.get_output_tensor_by_name
        names = ("draft_token_ids", "draft_parents", "hidden_states", *TARGET_FACTS, *LOGPROB_OUTPUTS,
                 *PROMPT_LOGPROB_OUTPUTS)
        outputs = {name: _host_array(get(resp, name)) for name in names}
        if model in (self.greedy_model_name, self.target_model_name):
            best, best_probs = (_host_array(get(resp, name)) for name in ("target_argmax", "target_argmax_probs"))
            if best is None or best_probs is None:
                raise RuntimeError(f"{model} answered without target_argmax / target_argmax_probs")
            outputs["output_ids"], outputs["output_log_probs"] = self._walk(
                best, best_probs, outputs["draft_token_ids"], outputs["draft_parents"], len(inps))
        else:
            outputs["output_ids"] = get(resp, "output_ids").as_numpy()
            outputs["output_log_probs"] = get(resp, "output_log_probs").as_numpy()
        out = decode_results(inps, outputs)
        self.stage_seconds["parse_response"] += time.perf_counter() - t2
        return out

    @staticmethod
    def _walk(best: np.ndarray, best_probs: np.ndarray, drafted: np.ndarray | None, parents: np.ndarray | None,
              rows: int) -> tuple[np.ndarray, np.ndarray]:
        """A round's greedy verification (:func:`~spec_decode.verifier.argmax_walk`, what the verifier runs for
        such rows) from target_model's ``target_argmax`` INT64 and ``target_argmax_probs`` FP32 [rows, k+1], the
        drafts ``draft_token_ids`` INT64 [rows, k] (None: no drafts) and their ``draft_parents`` INT32 [rows, k]
        (None: chains), rows padded (:mod:`.round_codec`). A row the target scored nothing for (a prompt chunk: no
        argmax) gets no token. Returns ``output_ids`` INT64 [rows, n] (padded with -1) and ``output_log_probs`` FP32
        [rows, n], as the verifier's."""
        width = best.reshape(rows, -1).shape[1]
        ids = np.full((rows, max(1, width)), -1, np.int64)
        lps = np.zeros(ids.shape, np.float32)
        best, best_probs = best.reshape(rows, -1), best_probs.reshape(rows, -1)
        meta = RoundDrafts.decode(rows, drafted, parents)
        for row in range(rows):
            row_best = strip_padding(best[row])
            if row_best:
                drafts, tree = meta.row(row)
                out, out_lps = argmax_walk(row_best, torch.from_numpy(best_probs[row]), drafts, tree)
                ids[row, : len(out)], lps[row, : len(out)] = out, out_lps
        return ids, lps

    def _unready_parts(self) -> str:
        """After a failed step: which step models are not ready (a model whose process died is unloaded and loaded
        again by the launcher's healer, :mod:`spec_decode.launcher.healer`), as text to append to the error, or ""."""
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

    async def run_batch(self, inps: list[StepInputs]) -> list[StepResult | BaseException]:
        """Run several sequences' steps (a round) through the ensemble, ``max_batch_size`` sequences per request.

        Returns:
            per step, its :class:`StepResult` or the exception that fails it. If a batched request fails, its steps
            are run again one by one, so that only the failing sequence fails (steps are idempotent: caches are keyed
            by the token ids, noise by (seed, step, position)).
        """
        chunks = [inps[i:i + self.max_batch_size] for i in range(0, len(inps), self.max_batch_size)]
        out: list[StepResult | BaseException] = []
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
        its own, after the next release that succeeds. A release that fails otherwise is logged and dropped. Errors
        are logged, not raised (docs/deployment.md).
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
