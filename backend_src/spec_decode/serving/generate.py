"""Backend of the decoupled ``generate`` model: tokenise, loop the ``spec_step`` ensemble over BLS, stream.

Each request runs as an asyncio task (the Python backend's async ``execute`` for decoupled models), so several streams
progress concurrently. Their steps run in rounds (:mod:`.rounds`): each round is one batched BLS call to ``spec_step``
(one row per sequence: :class:`~.triton_step.TritonStep`), so concurrent sequences share the draft's and the target's
forward passes. Each step's accepted tokens go to the client as one response (``stream=true``) or are gathered into a
single response (``stream=false``, for HTTP ``/generate``). At the end of a sequence, on errors and on cancellation, a
``release`` call frees the sequence's caches in every model. docs/client.md is the client contract (inputs, outputs,
errors); docs/metrics.md the metrics it exports.
"""

from __future__ import annotations

import logging
import random
import traceback

import numpy as np

from ..engine.model_loading import load_tokenizer, resolve_model_path
from ..generation import Chunk, Generation
from ..processors import TokenLogprobs, logprob_arrays
from ..proposers import PROPOSERS, DraftLMSettings, DraftModelProposer, k_schedule, offered_methods
from ..protocol import AUTO, StepInputs, StepResult
from ..scheduler.auto import AutoController
from ..scheduler.plan import Scheduler
from ..settings import DraftModelSettings, GenerateSettings, InvalidInputError, one_of, warn_unknown_parameters
from .adapter import error_response, read_inputs, request_parameters
from .generate_inputs import RequestLimits, check_parameters, parse_request
from .metrics import Metrics, stats_tuple
from .rounds import StepRounds
from .triton_step import TritonStep
from .wire import GENERATE_INPUTS, PROMPT_LOGPROB_OUTPUTS

logger = logging.getLogger(__name__)

ROUND_SECONDS = "spec_decode_round_seconds_total"


def end_token_ids(tokenizer, model_path) -> set[int]:
    """The ids that end generation: the tokenizer's ``eos_token_id`` and every ``eos_token_id`` of the model's
    ``generation_config.json`` (an int or a list: Llama-3.x-Instruct and Qwen2.5-Instruct list several), as
    transformers' ``generate`` stops at them."""
    ids = {tokenizer.eos_token_id} - {None}
    path = model_path / "generation_config.json" if model_path is not None else None
    if path is not None and path.is_file():
        import json

        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        ids.update(int(t) for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int))
    return ids


class GenerateBackend:
    """The ``generate`` model's logic: the client contract of docs/client.md, served as lockstep rounds of steps.

    Args:
        params: the config.pbtxt parameters (name -> string value): :class:`~spec_decode.settings.GenerateSettings`.
        pb_utils: the ``triton_python_backend_utils`` module.
        draft_params: draft_model's config parameters, when its config.pbtxt is beside this model's
            (:func:`~.adapter.sibling_parameters`): generate's largest k is held to draft_model's, and
            ``draft_model_available: auto`` follows its ``draft_model_path``.

    Raises:
        ValueError: a config parameter out of range or naming no tokenizer (named), a default method the server does
            not serve, a largest k above draft_model's, or ``draft_model_available: true`` where draft_model has no
            draft LM.
    """

    def __init__(self, params: dict[str, str], pb_utils, draft_params: dict[str, str] | None = None):
        warn_unknown_parameters("generate", params, set(GenerateSettings.parameter_names()))
        self.pb = pb_utils
        self.settings = s = GenerateSettings.from_params(params)
        tokenizer_path = resolve_model_path(s.tokenizer_path)
        if tokenizer_path is None:
            raise ValueError(f"config parameter 'tokenizer_path': {s.tokenizer_path!r} names no tokenizer")
        self.tokenizer = load_tokenizer(tokenizer_path)
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            raise ValueError(f"config parameter 'tokenizer_path': {s.tokenizer_path!r} has no fast tokenizer "
                             f"(tokenizer.json), which streaming needs")
        served = self._offered_methods(draft_params)
        methods = (*served, AUTO)  # auto chooses among the served single proposers and none, per step
        try:
            one_of("default_speculative_method", s.default_speculative_method, methods)
        except InvalidInputError as e:
            raise ValueError(f"config parameter {e.field!r}: {e.detail}") from None
        self.limits = RequestLimits(s, methods, len(self.tokenizer))
        self.eos_ids = end_token_ids(self.tokenizer, tokenizer_path)
        self.step = TritonStep(pb_utils)
        self.running = 0  # requests being generated (this instance)
        # Steps of concurrent sequences start together so that they share forward passes (see rounds.py).
        self.rounds = StepRounds(self._run_round, max_wait_s=s.step_round_max_wait_ms / 1000)
        self._rng = random.Random()
        self.scheduler = Scheduler(s.max_num_batched_tokens, s.disable_by_batch_size, self._controller(served))
        self.metrics = Metrics(pb_utils)
        self.metrics.set("spec_decode_running_sequences", 0)

    @staticmethod
    def _controller(served: tuple[str, ...]) -> AutoController:
        """speculative_method=auto's controller over the served single proposers (hybrid only composes them)."""
        singles = [m for m in served if m in PROPOSERS and m != "hybrid"]
        return AutoController(singles, [m for m in singles if PROPOSERS[m].applies_processors], singles,
                              [m for m in singles if PROPOSERS[m].greedy_trees],
                              [m for m in singles if PROPOSERS[m].tree_widths])

    def _offered_methods(self, draft_params: dict[str, str] | None) -> tuple[str, ...]:
        """The methods draft_model serves (:func:`~spec_decode.proposers.offered_methods`), checking generate's
        settings against draft_model's where its config is known (else its defaults: ``auto`` paths find the models
        ``make draft`` and ``make speculator`` build)."""
        s = self.settings
        forced = None if s.draft_model_available == "auto" else s.draft_model_available == "true"
        if draft_params is not None:
            draft_k = DraftModelSettings.from_params(draft_params).max_num_draft_tokens
            if s.max_num_draft_tokens > draft_k:
                raise ValueError(f"config parameter 'max_num_draft_tokens': {s.max_num_draft_tokens} is above "
                                 f"draft_model's max_num_draft_tokens={draft_k}, which refuses larger k (raise that "
                                 f"one too)")
            if forced and not DraftModelProposer.configured(DraftLMSettings.from_params(draft_params)):
                raise ValueError("config parameter 'draft_model_available': 'true', but draft_model's "
                                 f"draft_model_path {draft_params.get('draft_model_path', 'auto')!r} gives it no draft "
                                 f"LM")
        return offered_methods(draft_params or {}, forced)

    def _start(self, inputs: dict, parameters: dict | None = None) -> Generation:
        check_parameters(parameters or {})
        req = parse_request(inputs, self.limits)
        s = self.settings
        prompt_ids = self.tokenizer(req.text_input)["input_ids"]
        seed = req.random_seed if req.random_seed is not None else self._rng.getrandbits(63)
        seq_id = self._rng.getrandbits(63)
        return Generation(seq_id, prompt_ids, req, self.tokenizer, self.eos_ids, s.max_model_len, seed,
                          k_schedule(req.speculative_method, s.num_draft_tokens_schedule, s.max_num_draft_tokens))

    def _response(self, gen: Generation, chunk: Chunk, prefix: str = "", first: bool = False):
        pb = self.pb
        out = [
            pb.Tensor("text_output", np.array([(prefix + chunk.text).encode("utf-8")], np.object_)),
            pb.Tensor("output_ids", np.asarray(chunk.token_ids, np.int32)),
        ]
        req = gen.request
        if req.wants_logprobs:
            out.append(pb.Tensor("output_log_probs", np.asarray(chunk.log_probs, np.float32)))
        if req.top_logprobs > 0:
            asked = TokenLogprobs(chunk.log_probs, chunk.ranks, chunk.top_ids, chunk.top_log_probs)
            _, ranks, top_lps, top_ids = logprob_arrays(asked, np.int32, req.top_logprobs)
            out += [pb.Tensor("output_token_ranks", ranks), pb.Tensor("top_log_probs", top_lps),
                    pb.Tensor("top_log_prob_ids", top_ids)]
        if req.return_num_input_tokens:  # the vLLM backend's usage outputs, in every response
            out.append(pb.Tensor("num_input_tokens", np.array([gen.prompt_len], np.uint32)))
        if req.return_num_output_tokens:  # this response's tokens: a stream's sum to the completion's
            out.append(pb.Tensor("num_output_tokens", np.array([len(chunk.token_ids)], np.uint32)))
        if first and req.prompt_logprobs >= 0:
            arrays = logprob_arrays(gen.prompt_logprobs, np.int32, req.prompt_logprobs)
            out += [pb.Tensor(name, a) for name, a in zip(PROMPT_LOGPROB_OUTPUTS, arrays)]
        if chunk.finished:
            s = gen.stats
            if req.speculative_method == AUTO:  # what auto chose at each step
                out += [pb.Tensor("auto_methods", np.array([m.encode() for m in s.step_methods], np.object_)),
                        pb.Tensor("auto_num_draft_tokens", np.asarray(s.step_draft_tokens, np.int32)),
                        pb.Tensor("auto_draft_trees", np.asarray(s.step_draft_trees, np.bool_)),
                        pb.Tensor("auto_tree_top_k", np.asarray(s.step_tree_top_k, np.int32))]
            if req.wants_logprobs:
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
        """Serve one request to completion: every response goes through the request's response sender, the last
        with the FINAL flag. Never raises: a bad request or a failed step becomes an error response."""
        pb = self.pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            gen = self._start(read_inputs(request, GENERATE_INPUTS, pb), request_parameters(request))
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, ValueError):
                logger.error("generate: %s", traceback.format_exc())
            sender.send(error_response(exc, pb), flags=final)
            return
        req = gen.request
        whole = Chunk("", [])  # a non-streamed response: every chunk joined
        sent_first = False
        self._set_running(+1)
        try:
            self.rounds.join()
            try:
                while not gen.finished:
                    if sender.is_cancelled():
                        gen.cancel()
                        break
                    ran, result = await self.rounds.submit(gen.next_step())
                    if sender.is_cancelled():  # the client left during the step: send and count nothing more
                        gen.cancel()
                        break
                    if result.prefilled is not None:  # a chunk of the prompt (chunked prefill): nothing to send
                        gen.commit(result)
                        continue
                    before = stats_tuple(gen.stats)
                    chunk = gen.commit(result, ran)
                    self.metrics.record_step(req.speculative_method, ran.num_draft_tokens, before, gen.stats)
                    self._record_shape(req, ran, result)
                    if ran.auto:
                        self._record_choice(ran, before, gen.stats)
                    if req.stream:
                        if chunk.finished:
                            break
                        if chunk.token_ids or chunk.text:
                            sender.send(self._response(gen, chunk, first=not sent_first))
                            sent_first = True
                    else:
                        whole.text += chunk.text
                        whole.token_ids += chunk.token_ids
                        whole.log_probs += chunk.log_probs
                        whole.ranks += chunk.ranks
                        whole.top_ids += chunk.top_ids
                        whole.top_log_probs += chunk.top_log_probs
            finally:  # the other sequences' rounds need not wait for this one any more
                self.rounds.leave()
            if gen.finish_reason == "cancelled":
                # The client is gone: close the stream without data.
                sender.send(flags=final)
            elif req.stream:
                sender.send(self._response(gen, chunk, first=not sent_first), flags=final)
            else:
                whole.finished, whole.finish_reason = True, gen.finish_reason
                prefix = "" if req.exclude_input_in_output else req.text_input
                sender.send(self._response(gen, whole, prefix, first=True), flags=final)
        except Exception as exc:  # noqa: BLE001
            logger.error("generate: %s", traceback.format_exc())
            gen.finish_reason = "error"
            try:
                sender.send(error_response(exc, pb), flags=final)
            except Exception:  # noqa: BLE001 - the stream may already be closed
                pass
        finally:
            await self.step.release(gen)
            self.scheduler.release(gen.seq_id)
            self.metrics.add("spec_decode_requests_total", 1, method=req.speculative_method,
                             finish_reason=gen.finish_reason or "error")
            self._set_running(-1)

    async def _run_round(self, steps: list[StepInputs]) -> list[tuple[StepInputs, StepResult] | BaseException]:
        """One round of steps (:class:`StepRounds`): the scheduler plans it (speculation under load, ``auto``,
        ``max_num_batched_tokens``: :class:`~spec_decode.scheduler.plan.Scheduler`) and sends what runs as one
        batched request through the transport. Returns per step the step as it ran and its result (or the exception
        that fails it); the stages' times go to ``spec_decode_round_seconds_total``."""
        plan, results = await self.scheduler.run_round(steps, self.step.run_batch, running=self.running)
        self._record_round()
        return [r if isinstance(r, BaseException) else (plan.as_run(i), r) for i, r in enumerate(results)]

    def _record_round(self) -> None:
        """Count a round and bring ``spec_decode_round_seconds_total`` up to the transport's and the rounds' own
        totals (:attr:`TritonStep.stage_seconds`, :attr:`StepRounds.between_s`)."""
        self.metrics.add("spec_decode_rounds_total", 1)
        totals = {**getattr(self.step, "stage_seconds", {}), "plan": self.scheduler.plan_seconds,
                  "between_rounds": self.rounds.between_s}
        for stage, total in totals.items():
            self.metrics.add(ROUND_SECONDS, max(0.0, total - self.metrics.get(ROUND_SECONDS, stage=stage)),
                             stage=stage)

    def _record_choice(self, ran, before: tuple[int, int, int, int], after) -> None:
        """Count an auto step (``ran``: its inputs as run) by the method it chose (``none``: no speculation), with
        its drafts and acceptances, and whether it chose a tree."""
        method = ran.method
        self.metrics.add("spec_decode_auto_steps_total", 1, method=method)
        if ran.draft_tree:
            self.metrics.add("spec_decode_auto_tree_steps_total", 1, method=method, tree_top_k=str(ran.tree_top_k))
        self.metrics.add("spec_decode_auto_draft_tokens_total", after.draft_tokens - before[1], method=method)
        self.metrics.add("spec_decode_auto_accepted_tokens_total", after.accepted_tokens - before[2], method=method)

    def _record_shape(self, req, ran, result) -> None:
        """A committed step's tree and per-depth counters, and why a request that allowed a tree drafted a chain."""
        method = req.speculative_method
        self.metrics.record_depths(method, result.num_draft_tokens, result.draft_depth, len(result.output_ids) - 1)
        spec = ran.processors
        if req.draft_tree and ran.drafts and not ran.draft_tree and spec is not None \
                and spec.chains_only(len(ran.token_ids)):  # (auto choosing a chain is not a fallback)
            reason = "guided" if spec.guide_type else "prompt_logprobs"
            self.metrics.add("spec_decode_chain_fallback_steps_total", 1, method=method, reason=reason)

    def _set_running(self, delta: int) -> None:
        self.running += delta
        self.metrics.set("spec_decode_running_sequences", self.running)
        self.metrics.flush()  # a request started or ended: Prometheus sees it at once
