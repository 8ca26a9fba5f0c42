"""What the engine and the model proposers hold is freed by ``del`` alone: no reference cycle keeps a model, its KV
pool or (on CUDA) its captured graphs alive until a garbage collection that may never come (the GPU check's parts
load full-size models one after another)."""

import copy
import gc
import weakref

import pytest
import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.proposers import Eagle3Proposer, EagleProposer, ProposalRequest
from spec_decode.proposers.draft_lm import DraftModelProposer
from spec_decode.proposers.speculators import SpeculatorSettings
from spec_decode.sampling import SamplingParams
from spec_decode.sequences import SequenceLRU
from tests.helpers import save_tiny_eagle
from tests.speculator_checkpoints.eagle import write_eagle3

GREEDY = SamplingParams(0.0, 0, 1.0, 0)


@pytest.fixture
def no_gc():
    """The garbage collector off for the test (only reference counting frees), back on after."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_lru_holds_a_bound_method_weakly(no_gc):
    class Owner:
        def __init__(self):
            self.evicted = []
            self.lru = SequenceLRU(1, on_evict=self.evicted_one)

        def evicted_one(self, seq_id, value):
            self.evicted.append(seq_id)

    owner = Owner()
    owner.lru.put(1, "a")
    owner.lru.put(2, "b")
    assert owner.evicted == [1]  # the callback still runs while its owner lives
    ref = weakref.ref(owner)
    del owner
    assert ref() is None
    calls = []
    lru = SequenceLRU(1, on_evict=lambda s, v: calls.append(s))  # a plain function is held strongly
    lru.put(1, "a")
    lru.put(2, "b")
    assert calls == [1]


def test_cached_lm_freed_by_del(tiny_lm, no_gc):
    lm = CachedCausalLM(copy.deepcopy(tiny_lm), max_sequences=1, max_tokens=1024)
    lm.logits_batch([(1, [3, 4, 5], 3)])
    lm.logits_batch([(2, [6, 7, 8], 3)])  # evicts sequence 1 through the LRU's callback
    refs = [weakref.ref(lm), weakref.ref(lm.pool), weakref.ref(lm.model)]
    del lm
    assert [r() for r in refs] == [None, None, None]


def test_draft_lm_proposer_freed_by_del(tiny_lm, no_gc):
    proposer = DraftModelProposer(CachedCausalLM(copy.deepcopy(tiny_lm), max_sequences=1, max_tokens=1024))
    for seq in (1, 2):
        proposer.propose([ProposalRequest(seq, [3, 4, 5, 6], 2, GREEDY, 0)])
    refs = [weakref.ref(proposer), weakref.ref(proposer.lm)]
    del proposer
    assert [r() for r in refs] == [None, None]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_proposer_freed_by_del(method, tiny_lm, tiny_dir, tmp_path, no_gc):
    folder = (save_tiny_eagle(tiny_lm, tmp_path / "eagle") if method == "eagle"
              else write_eagle3(tmp_path / "eagle3", 32, 97, 4, 2, 64, 48, layer_ids=[0, 1, 1]))
    cls = EagleProposer if method == "eagle" else Eagle3Proposer
    settings = SpeculatorSettings(speculator_path=str(folder), target_model_path=str(tiny_dir), device="cpu",
                                  speculator_min_token_prob=0.0, max_sequences=1)
    gc.enable()  # loading may make cycles of its own (transformers' config objects): collected before the check
    proposer = cls.from_config(settings, {})
    assert proposer is not None
    gc.collect()
    gc.disable()
    width = 32 if method == "eagle" else 96
    for seq in (1, 2):  # the second evicts the first's context through the LRU's callback
        proposer.propose([ProposalRequest(seq, [3, 4, 5, 6], 2, GREEDY, 0, torch.randn(4, width))])
    ref = weakref.ref(proposer)
    del proposer
    assert ref() is None
