"""Helpers shared by the tests."""

import fcntl
import os
import shutil
from pathlib import Path

import numpy as np


def step_row(seq, ids, drafts=(), **kw) -> dict:
    """One sequence's row of a step model's request (greedy; overrides as keyword arguments)."""
    base = {"sequence_id": np.array([seq], np.uint64), "token_ids": np.array(ids, np.int64),
            "draft_token_ids": np.array(drafts, np.int64), "temperature": np.array([0.0], np.float32),
            "top_k": np.array([0], np.int32), "top_p": np.array([1.0], np.float32), "release": np.array([False]),
            "random_seed": np.array([0], np.int64), "step": np.array([0], np.int64)}
    base.update({k: np.array([v]) if not isinstance(v, np.ndarray) else v for k, v in kw.items()})
    return base


def tiny_eagle_config() -> dict:
    """The sizes of an EAGLE head over the tiny test Llama (conftest ``tiny_lm``: hidden 32, 4 heads, 2 of them
    key/value heads, 1,024 positions)."""
    return {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024}


def save_tiny_eagle(tiny_lm, folder, seed: int = 0):
    """An untrained EAGLE-1 head over ``tiny_lm`` (its embedding; random layer) written as the EAGLE authors publish
    one (``speculative_method=eagle``); returns the folder. Serve it with ``speculator_path`` and
    ``target_model_path`` (the tiny target's folder)."""
    from tests.speculator_checkpoints.eagle import write_eagle1

    return write_eagle1(folder, tiny_lm.get_input_embeddings().weight.detach(), 4, 2, 64, seed=seed)


def tiny_head_params(folder, target_dir, min_token_prob: str = "0") -> dict[str, str]:
    """draft_model config parameters that serve the head in ``folder`` for the tiny target in ``target_dir``."""
    return {"speculator_path": str(folder), "target_model_path": str(target_dir),
            "speculator_min_token_prob": min_token_prob}


def confidence_rule(every):
    """Per proposal drafted at every slot: (running product of its drafts' probabilities, float64 [n]; the rule's
    confidence at each slot, float64 [n]: the product before the slot times the slot's top probability), checking
    that each proposal's score is the sum of its running products."""
    import pytest
    import torch

    running, confidence = [], []
    for p in every:
        chosen = p.draft_probs[torch.arange(len(p.draft_token_ids)), p.draft_token_ids].double()
        running.append(torch.cumprod(chosen, 0))
        confidence.append(torch.cat([torch.ones(1, dtype=torch.float64), running[-1][:-1]])
                          * p.draft_probs.double().max(-1).values)
        assert p.score == pytest.approx(float(running[-1].sum()), rel=1e-5)
    return running, confidence


def assert_cut_by_rule(every, cut, running, confidence, t, **close) -> list:
    """Each proposal of ``cut`` (min_token_prob = ``t``) is its every-slot proposal's prefix up to the first slot whose
    confidence is below ``t``, with the same probabilities and the prefix's score; returns the prefix lengths."""
    import pytest
    import torch

    lengths = []
    for p, q, run, conf in zip(every, cut, running, confidence):
        n = int((conf >= t).cumprod(0).sum())
        lengths.append(n)
        assert q.draft_token_ids.tolist() == p.draft_token_ids[:n].tolist()
        if n:
            torch.testing.assert_close(q.draft_probs, p.draft_probs[:n], **close)
            assert q.score == pytest.approx(float(run[:n].sum()), rel=1e-4)
    return lengths


def random_dist(gen, *shape, sharp=1.0):
    """Random probability rows [*shape] (softmax of sharp x normal noise from the torch generator ``gen``)."""
    import torch

    return torch.softmax(torch.randn(*shape, generator=gen) * sharp, dim=-1)


def assert_token_law(col, expected, v, label):
    """Chi-square of the tokens ``col`` against ``expected`` [V] (zero entries: the token must never appear);
    fails below p = 1e-3."""
    from scipy.stats import chisquare

    counts = np.bincount(col, minlength=v)
    expected = np.asarray(expected, dtype=np.float64)
    zero = expected <= 0
    assert counts[zero].sum() == 0, (label, counts, expected)
    _, pvalue = chisquare(counts[~zero], expected[~zero] / expected[~zero].sum() * len(col))
    assert pvalue > 1e-3, (label, counts, expected)


def head_round(hidden: int, vocab: int, temperature: float, n: int = 8) -> list:
    """A round for a head proposer: ``n`` requests of random ids (4 + s of them), k 1..5, greedy (odd s) or sampled
    at ``temperature`` with seed s, with 1..3 random hidden states [m, hidden]; then one request without hidden states
    (sequence 99), which must get no drafts."""
    import torch

    from spec_decode.proposers.base import ProposalRequest
    from spec_decode.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    reqs = [ProposalRequest(s, torch.randint(0, vocab, (4 + s,), generator=g).tolist(), 1 + s % 5,
                            SamplingParams() if s % 2 else SamplingParams(temperature=temperature, seed=s), s,
                            torch.randn(1 + s % 3, hidden, generator=g) * 3) for s in range(n)]
    reqs.append(ProposalRequest(99, [4, 8], 3, SamplingParams(), 0, None))
    return reqs


def assert_batched_as_alone(proposer, reqs: list) -> list:
    """``proposer.propose(reqs)`` gives each request the drafts and draft probabilities it gets alone; the last
    request (no hidden states) gets none. Returns the batched proposals of the others."""
    import torch

    together = proposer.propose(reqs)
    assert together[-1].draft_token_ids.numel() == 0
    for r, t in zip(reqs[:-1], together):
        alone = proposer.propose([r])[0]
        assert t.draft_token_ids.tolist() == alone.draft_token_ids.tolist()
        torch.testing.assert_close(t.draft_probs, alone.draft_probs)
    return together[:-1]


def peaked_lm(seed: int, scale: float, vocab: int):
    """A tiny random Llama over ``vocab`` tokens whose LM head is scaled up by ``scale``, so its distributions are
    peaked (a processor's effect, or a sampler's bias, on them is large)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    lm = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        lm.lm_head.weight *= scale
    return lm


class UniformDrafts:
    """A proposer (subclass it with :class:`~spec_decode.proposers.Proposer` first, and set ``vocab``) that drafts
    each token from q = uniform over the vocabulary, seeded by the request's seed and step, so rejection sampling
    sees real draft probabilities."""

    name = "uniform"
    vocab = 0

    def propose(self, requests):
        import torch

        from spec_decode.proposers import Proposal
        from spec_decode.sampling import generator_for

        out = []
        for r in requests:
            g = generator_for(r.params.seed, r.step, 99)
            drafts = torch.randint(self.vocab, (r.k,), generator=g)
            out.append(Proposal(drafts, torch.full((r.k, self.vocab), 1 / self.vocab)))
        return out


def plain_stop_cut(tokenizer, prompt_ids, ids, stop_words, min_tokens):
    """Where a plain decoder stops ``ids`` on a stop word, token by token (vLLM's definition, written apart from
    ``spec_decode.generation``): the first output token n >= ``min_tokens`` whose text completes an occurrence of a stop
    word that ends past the text of tokens 1..n-1 -> (n, the text cut before that occurrence), or None (no stop).
    Text is tokenizers' ``DecodeStream`` over the prompt then each id, as generate streams it."""
    from tokenizers.decoders import DecodeStream

    stream, text = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True), ""
    for n, t in enumerate(ids, 1):
        before = len(text)
        text += stream.step(tokenizer.backend_tokenizer, t) or ""
        if n < min_tokens:
            continue
        hits = [i for w in stop_words for i in range(len(text) - len(w) + 1)
                if text.startswith(w, i) and i + len(w) > before]
        if hits:
            return n, text[: min(hits)]
    return None


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder ``name``, filled by ``build(folder)`` once per test run. Under pytest-xdist (``make test`` runs two
    workers) the first worker to ask builds it in the workers' common temporary folder while the others wait on a
    lock, then all read it; in a single process it is this process's own temporary folder."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name) / name
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent  # pytest-<n>/, shared by this run's workers
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder
