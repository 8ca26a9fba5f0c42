"""The ``spec_step`` ensemble in one process: the three step models' backends called as Triton calls them.

:class:`LocalEnsemble` runs a round of steps (one per sequence) through :class:`~.draft_model.DraftBackend`,
:class:`~.target_model.TargetBackend` and :class:`~.verifier_model.VerifierBackend` with the tensors laid out as they
cross the real ensemble: generate's request (:func:`~.step_inputs.round_inputs`: the round's rows stacked and
padded with -1), each model gets one inputs dict per row (as :func:`~.adapter.read_rows` gives it),
draft_model and target_model serve the round through ``run_batch`` (one batched forward each), the verifier in one
call, and each model's outputs are stacked and padded to the round's largest k before the next model reads them. A
round without drafts skips draft_model, as generate's ``score_step`` ensemble does.

It is what ``make gpu-check`` (``bench/gpu_check``) runs on a GPU machine that has no tritonserver: the served models'
CUDA path (KV caches and batched rounds on the device, probabilities that never leave it) without Triton's processes.
"""

from __future__ import annotations

import numpy as np

from ..processors import TokenLogprobs
from ..protocol import StepInputs, StepResult
from .adapter import stack_rows, strip_padding
from .step_inputs import round_inputs


def _stack(outputs: list[dict], name: str):
    """One output of every row, stacked and padded as the ensemble hands it to the next model."""
    return stack_rows([o[name] for o in outputs])


def _raise_first(outputs: list) -> list[dict]:
    """A request with a failing row fails as a whole (the ensemble's error response): raise that row's exception."""
    for o in outputs:
        if isinstance(o, Exception):
            raise o
    return outputs


class LocalEnsemble:
    """draft_model -> target_model -> verifier for a round of sequences, in this process.

    Args:
        draft: a :class:`~.draft_model.DraftBackend`.
        target: a :class:`~.target_model.TargetBackend`.
        verifier: a :class:`~.verifier_model.VerifierBackend`.
    """

    def __init__(self, draft, target, verifier):
        self.draft, self.target, self.verifier = draft, target, verifier

    def _run(self, inps: list[StepInputs], release: bool) -> list[dict]:
        inputs = round_inputs(inps, release)
        rows = [{name: v[row] for name, v in inputs.items()} for row in range(len(inps))]
        if "num_draft_tokens" in inputs:
            drafted = _raise_first(self.draft.run_batch(rows))
            draft_ids, draft_probs = _stack(drafted, "draft_token_ids"), _stack(drafted, "draft_probs")
        else:  # score_step: no draft_model hop
            draft_ids, draft_probs = inputs["draft_token_ids"], inputs["draft_probs"]
        for row, r in enumerate(rows):
            r["draft_token_ids"], r["draft_probs"] = draft_ids[row], draft_probs[row]
        scored = _raise_first(self.target.run_batch(rows))
        target_probs, hidden = _stack(scored, "target_probs"), _stack(scored, "hidden_states")
        log_probs = _stack(scored, "log_probs")
        argmax, argmax_probs = _stack(scored, "target_argmax"), _stack(scored, "target_argmax_probs")
        for row, r in enumerate(rows):
            r["target_probs"], r["log_probs"] = target_probs[row], log_probs[row]
            r["target_argmax"], r["target_argmax_probs"] = argmax[row], argmax_probs[row]
        outs = _raise_first(self.verifier.run_batch([{name: r[name] for name in self.verifier.INPUTS if name in r}
                                                     for r in rows]))
        for row, (o, row_ids, s) in enumerate(zip(outs, draft_ids, scored)):
            o["num_drafted"] = len(strip_padding(row_ids))
            o["hidden_states"] = hidden[row]
            o["scored"] = s
        return outs

    def run_round(self, inps: list[StepInputs]) -> list[StepResult]:
        """Run one step of every sequence in ``inps`` (distinct seq_ids); returns their results in order.

        Raises:
            ValueError: an invalid input of any row (the first such row's error, as the ensemble's error response).
        """
        results = []
        for inp, o in zip(inps, self._run(inps, release=False)):
            ids = strip_padding(o["output_ids"])
            hidden = np.asarray(o["hidden_states"].float().cpu() if hasattr(o["hidden_states"], "cpu")
                                else o["hidden_states"], np.float32)[:len(ids)]
            res = StepResult(ids, o["num_drafted"], np.asarray(o["output_log_probs"])[:len(ids)].tolist(), hidden)
            spec = inp.processors
            if spec is not None and spec.logprobs:
                res.logprobs = TokenLogprobs(res.log_probs or [], np.asarray(o["output_token_ranks"]).tolist(),
                                             np.asarray(o["top_log_prob_ids"]).tolist(),
                                             np.asarray(o["top_log_probs"]).tolist())
            p = o["scored"]
            res.cached_tokens = int(np.asarray(p["num_cached_tokens"]).reshape(-1)[0])
            res.forward_seconds = float(np.asarray(p["target_forward_seconds"]).reshape(-1)[0])
            if spec is not None and spec.prompt_logprobs_at(len(inp.token_ids)):
                res.prompt = TokenLogprobs(p["prompt_log_probs"].tolist(), p["prompt_token_ranks"].tolist(),
                                           p["prompt_top_log_prob_ids"].tolist(), p["prompt_top_log_probs"].tolist())
            results.append(res)
        return results

    def release(self, inps: list[StepInputs]) -> None:
        """Free the sequences' caches in every model; their final ``token_ids`` join the suffix cache.

        Raises:
            ValueError: as :meth:`run_round`.
        """
        self._run(inps, release=True)
