"""spec_decode.serving.local_ensemble: the three step backends in one process, as the ensembles run them."""

import numpy as np
import torch

from spec_decode.generation import Generation
from spec_decode.request import GenerationRequest
from spec_decode.serving.draft_model import DraftBackend
from spec_decode.serving.local_ensemble import LocalEnsemble
from spec_decode.serving.target_model import TargetBackend
from spec_decode.serving.verifier_model import VerifierBackend
from tests.helpers import step_row


def test_drafts_outside_the_vocabulary_end_the_drafts_instead_of_failing_the_step(tiny_dir, tiny_lm, real_tokenizer):
    """A direct caller releases a 'response' of ids the target does not have into suffix decoding's cache of earlier
    responses (token ids are checked against int32 only there: draft_model need not know the target's vocabulary).
    Later requests whose context matches it get those ids as drafts: target_model and the verifier end the drafts at
    the first one outside the vocabulary, so the steps succeed with the target's own greedy output (they failed every
    such request)."""
    draft = DraftBackend({"draft_model_path": "", "suffix_backend": "python", "suffix_max_cached_requests": "8"})
    ens = LocalEnsemble(draft, TargetBackend({"model_path": str(tiny_dir), "device": "cpu"}),
                        VerifierBackend({"backend": "torch", "num_threads": "0"}))
    prompt = [5, 17, 3]
    poison = step_row(99, [1], num_draft_tokens=np.array([4], np.int32), seeded=np.array([False]),
                      speculative_method=np.array([b"suffix"], object))
    draft.run_batch([poison])
    draft.run_batch([dict(poison, release=np.array([True]), token_ids=np.array([1, *prompt, 500, 501, 502], np.int64))])
    assert draft.metrics.get("spec_decode_suffix_cached_responses") == 1
    gen = Generation(1, prompt, GenerationRequest("x", 12, speculative_method="suffix"), real_tokenizer, [], 256, 0)
    steps = 0
    while not gen.finished:
        inp = gen.next_step()
        (result,) = ens.run_round([inp])
        if steps == 0:
            assert result.num_draft_tokens >= 1  # the poisoned response was proposed
        gen.commit(result)
        steps += 1
    ens.release([gen.next_step()])
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 3:].tolist()
    assert gen.output_ids == ref


def test_hidden_states_reach_the_proposer_aligned_through_varying_acceptance_rollbacks_and_retries(
        tiny_dir, tiny_lm, real_tokenizer, monkeypatch):
    """A proposer that reads the target's hidden states gets, with every step, those at the positions before the last
    committed token, as a full forward of the target computes them: through steps that accept 0..3 drafts (the rest
    rejected: the caches roll back) and a round run twice (a retry)."""
    from spec_decode.proposers import Proposal, Proposer, registry

    prompt, n_new = [5, 17, 3, 9], 24
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=n_new + 8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0].tolist()
        out = tiny_lm(torch.tensor([ref]), output_hidden_states=True)
    full_hidden = out.hidden_states[-1][0]  # [T, H] after the final norm
    seen = []

    class Scripted(Proposer):
        """Drafts a of the target's own next tokens (a = step % 4), then one it rejects."""

        name, needs_hidden_states = "scripted", True

        def __init__(self, settings=None):
            pass

        def propose(self, requests):
            out = []
            for r in requests:
                seen.append((len(r.token_ids), r.hidden_states))
                n, a = len(r.token_ids), r.step % 4
                good = ref[n : n + a]
                out.append(Proposal.of((good + [(ref[n + a] + 1) % 97])[: r.k]))
            return out

    monkeypatch.setattr(registry, "PROPOSERS", {**registry.PROPOSERS, "scripted": Scripted})
    monkeypatch.setattr(registry, "METHODS", (*registry.METHODS, "scripted"))
    ens = LocalEnsemble(DraftBackend({"draft_model_path": "", "suffix_backend": "python"}),
                        TargetBackend({"model_path": str(tiny_dir), "device": "cpu"}),
                        VerifierBackend({"backend": "torch", "num_threads": "0"}))
    gen = Generation(3, prompt, GenerationRequest("x", n_new, speculative_method="scripted", num_draft_tokens=4),
                     real_tokenizer, [], 256, 0)
    accepted = set()
    while not gen.finished:
        inp = gen.next_step()
        (result,) = ens.run_round([inp])
        if inp.step == 2:  # the same step again, as generate retries a failed round: the same tokens and states
            (again,) = ens.run_round([inp])
            assert again.output_ids == result.output_ids
            np.testing.assert_allclose(again.hidden_states, result.hidden_states, atol=1e-5)
        accepted.add(len(result.output_ids) - 1)
        gen.commit(result)
    ens.release([gen.next_step()])
    assert gen.output_ids == ref[len(prompt): len(prompt) + n_new]
    assert accepted >= {0, 1, 2, 3}
    assert seen[0][1] is None  # the first step: no target state yet
    for length, hidden in seen[1:]:
        m = len(hidden)
        assert 1 <= m <= 4
        torch.testing.assert_close(hidden, full_hidden[length - 1 - m : length - 1], atol=1e-4, rtol=1e-4)
