"""The ``spec_step`` ensemble in one process: the three step models' backends called as Triton calls them.

:class:`LocalEnsemble` runs a round of steps (one per sequence) through :class:`~.draft_model.DraftBackend`,
:class:`~.target_model.TargetBackend` and :class:`~.verifier_model.VerifierBackend` with the tensors laid out as they
cross the real ensemble: generate's request (:func:`~.round_codec.encode_round`: the round's rows stacked and
padded with -1), each model gets one inputs dict per row (as :func:`~.adapter.read_rows` gives it),
draft_model and target_model serve the round through ``run_batch`` (one batched forward each), the verifier in one
call, and each model's outputs are stacked and padded to the round's largest k before the next model reads them. A
round without drafts skips draft_model, as generate's ``score_step`` ensemble does.

It is what ``make gpu-check`` (``bench/gpu_check``) runs on a GPU machine that has no tritonserver: the served models'
CUDA path (KV caches and batched rounds on the device, probabilities that never leave it) without Triton's processes.
"""

from __future__ import annotations

import numpy as np

from ..protocol import StepInputs, StepResult
from .adapter import stack_rows
from .round_codec import LOGPROB_OUTPUTS, TARGET_FACTS, decode_results, encode_round
from .wire import PROMPT_LOGPROB_OUTPUTS


def _stack(outputs: list[dict], name: str):
    """One output of every row, stacked and padded as the ensemble hands it to the next model."""
    return stack_rows([o[name] for o in outputs])


def _host(x) -> np.ndarray:
    """A stacked output as a host numpy array (float32 for floating tensors, as the ensemble's outputs travel)."""
    if hasattr(x, "cpu"):
        return (x.float() if x.is_floating_point() else x).cpu().numpy()
    return np.asarray(x)


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

    def _run(self, inps: list[StepInputs], release: bool) -> dict:
        """The round through the three models; its stacked outputs by wire name, as host arrays."""
        inputs = encode_round(inps, release)
        rows = [{name: v[row] for name, v in inputs.items()} for row in range(len(inps))]
        parents = None
        if "num_draft_tokens" in inputs:
            drafted = _raise_first(self.draft.run_batch(rows))
            draft_ids, draft_probs = _stack(drafted, "draft_token_ids"), _stack(drafted, "draft_probs")
            parents = _stack(drafted, "draft_parents")
        else:  # score_step: no draft_model hop
            draft_ids, draft_probs = inputs["draft_token_ids"], inputs["draft_probs"]
        for row, r in enumerate(rows):
            r["draft_token_ids"], r["draft_probs"] = draft_ids[row], draft_probs[row]
            if parents is not None:
                r["draft_parents"] = parents[row]
        scored = _raise_first(self.target.run_batch(rows))
        target_probs, hidden = _stack(scored, "target_probs"), _stack(scored, "hidden_states")
        log_probs = _stack(scored, "log_probs")
        argmax, argmax_probs = _stack(scored, "target_argmax"), _stack(scored, "target_argmax_probs")
        for row, r in enumerate(rows):
            r["target_probs"], r["log_probs"] = target_probs[row], log_probs[row]
            r["target_argmax"], r["target_argmax_probs"] = argmax[row], argmax_probs[row]
        outs = _raise_first(self.verifier.run_batch([{name: r[name] for name in self.verifier.INPUTS if name in r}
                                                     for r in rows]))
        verified = {name: _host(_stack(outs, name)) for name in ("output_ids", "output_log_probs", *LOGPROB_OUTPUTS)}
        facts = {name: _host(_stack(scored, name)) for name in (*TARGET_FACTS, *PROMPT_LOGPROB_OUTPUTS)}
        return {**verified, **facts, "hidden_states": _host(hidden), "draft_token_ids": _host(draft_ids),
                "draft_parents": None if parents is None else _host(parents)}

    def run_round(self, inps: list[StepInputs]) -> list[StepResult]:
        """Run one step of every sequence in ``inps`` (distinct seq_ids); returns their results in order
        (:func:`~.round_codec.decode_results` of the round's stacked outputs, as generate decodes the ensemble's).

        Raises:
            ValueError: an invalid input of any row (the first such row's error, as the ensemble's error response).
        """
        return decode_results(inps, self._run(inps, release=False))

    def release(self, inps: list[StepInputs]) -> None:
        """Free the sequences' caches in every model; their final ``token_ids`` join the suffix cache.

        Raises:
            ValueError: as :meth:`run_round`.
        """
        self._run(inps, release=True)
