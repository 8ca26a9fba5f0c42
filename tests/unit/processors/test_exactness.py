"""Logits processors under speculation, in process on a tiny model: greedy output equals ``none``'s with the same
processors for a model proposer, a proposer whose drafts come from a distribution of its own and one that copies
forbidden tokens, at k = 1 and 4; sampled output keeps the processed target law exactly (chi-square on the second
token's marginal over seeds); log-probs and top-N equal ``none``'s."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.processors import ProcessorSpec, process_logits
from spec_decode.proposers import DraftModelProposer, Proposal, Proposer
from spec_decode.request import GenerationRequest
from tests.helpers import UniformDrafts, peaked_lm

V = 12  # a vocabulary small enough that the law test can check the joint law of three tokens
PROMPT = [5, 7, 3, 9, 7]


def _peaked_lm(seed: int, scale: float):
    """A tiny random Llama over V tokens with peaked distributions (a processor's effect on them is large)."""
    return peaked_lm(seed, scale, V)


class UniformProposer(UniformDrafts, Proposer):
    """Drafts each token from q = uniform over the vocabulary (forbidden tokens included)."""

    vocab = V


class CopyProposer(Proposer):
    """Drafts a fixed run of tokens without probabilities (as n-gram and suffix copy text): the bad word's tokens and
    an end id, which the processors forbid."""

    name = "copy"
    run = (10, 11, 0, 3, 9)

    def propose(self, requests):
        return [Proposal.of(list(self.run[: r.k])) for r in requests]


class TreeProposer(Proposer):
    """Drafts a tree without probabilities (as suffix decoding and n-gram lookup do), breadth first within k nodes:
    three root-level branches, then a child of each, forbidden tokens among them (spec_decode.tree); a chain (the
    copy run) where the request asks for one."""

    name = "tree"
    tokens = (10, 0, 9, 11, 3, 10, 0, 5)
    parents = (-1, -1, -1, 0, 1, 2, 3, 4)

    def propose(self, requests):
        return [Proposal.of(list(self.tokens[: r.k]), None, list(self.parents[: r.k])) if r.tree
                else Proposal.of(list(CopyProposer.run[: r.k])) for r in requests]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def target_lm():
    return _peaked_lm(0, 6.0)


@pytest.fixture(scope="module")
def step(target_lm):
    return LocalStep({"uniform": UniformProposer(), "copy": CopyProposer(),
                      "self": DraftModelProposer(CachedCausalLM(target_lm)), "tree": TreeProposer(),
                      "draft": DraftModelProposer(CachedCausalLM(_peaked_lm(1, 3.0)))},
                     TargetScorer(CachedCausalLM(target_lm)))


SPEC = ProcessorSpec(len(PROMPT), repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4, min_tokens=2,
                     stop_ids=(0, 3), bad_words=((10, 11), (6,)), logprobs=True, top_logprobs=5)


def _run(step, real_tokenizer, method, k, n, spec=SPEC, seq=1, **kw):
    if spec is not None and spec.logprobs:
        kw["top_logprobs"] = spec.top_logprobs
    req = GenerationRequest("x", n, speculative_method=method, num_draft_tokens=k, **kw)
    gen = Generation(seq, PROMPT, req, real_tokenizer, [], 256, kw.get("random_seed", 0))
    gen.stop_ids = set(spec.stop_ids) if spec is not None else set()
    gen.processors = spec
    chunks = run_local(gen, step)
    return gen, chunks


@pytest.mark.parametrize("method", ["self", "draft", "uniform", "copy", "tree"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_processors_equals_none_s(step, real_tokenizer, method, k):
    plain, plain_chunks = _run(step, real_tokenizer, "none", 0, 24, seq=10)
    spec_gen, chunks = _run(step, real_tokenizer, method, k, 24, seq=11)
    assert spec_gen.output_ids == plain.output_ids
    assert spec_gen.stats.draft_tokens > 0
    without, _ = _run(step, real_tokenizer, "none", 0, 24, spec=None, seq=12)
    assert without.output_ids != plain.output_ids  # the processors changed something
    out = spec_gen.output_ids
    assert not any(out[i:i + 2] == [10, 11] for i in range(len(out))) and 6 not in out
    assert not {0, 3} & set(out[:2])
    # log-probs and top-N equal none's, token for token, from every position of a step (not only its first)
    lps = [x for c in chunks for x in c.log_probs]
    top = [x for c in chunks for x in c.top_ids]
    assert len(lps) == len(top) == len(out) and all(len(t) == 5 for t in top)
    np.testing.assert_allclose(lps, [x for c in plain_chunks for x in c.log_probs], atol=1e-4)
    assert top == [x for c in plain_chunks for x in c.top_ids]
    ranks = [x for c in chunks for x in c.ranks]
    assert ranks == [x for c in plain_chunks for x in c.ranks]


def test_the_log_prob_rows_are_raw_and_ranked(step, real_tokenizer, target_lm):
    gen, chunks = _run(step, real_tokenizer, "self", 4, 6, seq=20)
    assert gen.stats.accepted_tokens > 0
    ids = PROMPT + gen.output_ids
    with torch.inference_mode():
        logits = target_lm(torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1]
    raw = torch.log_softmax(logits, -1)
    lps = [x for c in chunks for x in c.log_probs]
    np.testing.assert_allclose(lps, raw.gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0], atol=1e-4)
    ranks = [x for c in chunks for x in c.ranks]
    assert ranks == [1 + int((raw[j] > raw[j, t]).sum()) for j, t in enumerate(gen.output_ids)]
    top = [x for c in chunks for x in c.top_log_probs]
    assert all(row == sorted(row, reverse=True) for row in top)


def _processed(lm, ids, spec):
    with torch.inference_mode():
        logits = lm(torch.tensor([ids])).logits[0, -1:]
    return torch.softmax(process_logits(logits, spec, ids)[0].double(), -1)


@pytest.mark.parametrize("method", ["self", "uniform", "draft", "copy", "tree"])
def test_sampled_output_keeps_the_processed_target_law(step, real_tokenizer, target_lm, method):
    """The joint law of the first three output tokens (drawn at positions 0, 1, 2 of one step when the drafts are
    accepted) is the processed target's: penalties counting the drafts before each position, min_tokens lifting at
    index 2 (an end id then ends the output), the bad word forbidding 11 right after 10."""
    spec = replace(SPEC, logprobs=False, top_logprobs=0, stop_ids=(0,))  # one end id: an output of 2 ended with it
    joint = np.zeros((V, V, V))
    p1 = _processed(target_lm, PROMPT, spec)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = _processed(target_lm, PROMPT + [a], spec)
        for b in range(V):
            if p2[b] > 0:
                joint[a, b] = float(p1[a] * p2[b]) * _processed(target_lm, PROMPT + [a, b], spec).numpy()
    joint = joint.reshape(-1)
    n = 2000
    seen = []
    accepted = 0
    for s in range(n):
        gen, _ = _run(step, real_tokenizer, method, 3, 3, spec=spec, seq=1000 + s, temperature=1.0, random_seed=s)
        a, b, c = (gen.output_ids + [0])[:3]  # the end id that stopped it is not emitted
        seen.append((a * V + b) * V + c)
        accepted += gen.stats.accepted_tokens
    counts = np.bincount(seen, minlength=V ** 3)
    assert counts[joint == 0].sum() == 0  # never a forbidden token
    big = joint * n >= 5
    observed, expected = counts[big], joint[big] * n
    if joint[~big].sum() > 0:
        observed, expected = np.append(observed, counts[~big].sum()), np.append(expected, joint[~big].sum() * n)
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3
    if method == "self":
        assert accepted > n  # the drafts were mostly accepted: positions 1 and 2 of the step were sampled
