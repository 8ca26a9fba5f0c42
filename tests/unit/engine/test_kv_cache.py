"""spec_decode.engine.kv_cache: the per-sequence KV caches (reuse, rollback, LRU, batched rounds, growth) on a tiny
model."""

import pytest
import torch

from spec_decode.engine.kv_cache import CachedCausalLM


def _full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_cached_logits_equal_uncached_across_rollback(tiny_lm):
    lm = CachedCausalLM(tiny_lm, max_sequences=4)
    seq = [3, 14, 15, 92, 65, 35, 89, 79]
    out = lm.logits(1, seq[:5], 1)
    torch.testing.assert_close(out, _full_logits(tiny_lm, seq[:5])[-1:], atol=1e-5, rtol=1e-4)
    # Extend with "drafts", then roll back to a different continuation: the cache must crop to the common prefix.
    lm.logits(1, seq[:5] + [1, 2, 3], 4)
    alt = seq[:6] + [7, 7]
    out = lm.logits(1, alt, 3)
    torch.testing.assert_close(out, _full_logits(tiny_lm, alt)[-3:], atol=1e-5, rtol=1e-4)
    assert lm.cached_ids(1) == alt
    # Asking again for the last position of the cached tokens recomputes just that token.
    torch.testing.assert_close(lm.logits(1, alt, 1), _full_logits(tiny_lm, alt)[-1:], atol=1e-5, rtol=1e-4)


def test_batched_logits_equal_each_sequence_alone(tiny_lm):
    """logits_batch over sequences with different cached lengths, new-token counts and rollbacks = full forwards."""
    import random

    rng = random.Random(0)
    lm = CachedCausalLM(tiny_lm, max_sequences=8, max_batched_new_tokens=6)
    batched = []
    forward_batch = lm._forward_batch
    lm._forward_batch = lambda batch: batched.append(len(batch)) or forward_batch(batch)
    seqs = {s: [rng.randrange(97) for _ in range(rng.randint(1, 12))] for s in range(5)}
    for rnd in range(6):
        calls = []
        for s, ids in seqs.items():
            if rnd and len(ids) > 1 and rng.random() < 0.3:  # roll back some sequences (rejected drafts)
                del ids[len(ids) - rng.randint(1, min(3, len(ids) - 1)) :]
            ids += [rng.randrange(97) for _ in range(rng.randint(1, 5))]
            calls.append((s, list(ids), rng.randint(1, min(len(ids), 5))))
        if rnd == 3:
            calls.append((9, [rng.randrange(97) for _ in range(20)], 2))  # a long prefill runs alone
        for (s, ids, n), got in zip(calls, lm.logits_batch(calls)):
            torch.testing.assert_close(got, _full_logits(tiny_lm, ids)[-n:], atol=1e-5, rtol=1e-4)
            assert lm.cached_ids(s) == ids
            assert not got.requires_grad  # no autograd graph kept alive by the caches (it grew without bound)
    assert len(batched) >= 5 and min(batched) >= 2  # rounds after the prefills ran as one batched forward
    with pytest.raises(ValueError, match="once per batch"):
        lm.logits_batch([(1, [1, 2], 1), (1, [1, 2], 1)])
    with pytest.raises(ValueError, match="token ids"):
        lm.logits_batch([(1, [1, 2], 1), (2, [1, 500], 1)])


def test_cache_is_lru_bounded_and_released(tiny_lm):
    lm = CachedCausalLM(tiny_lm, max_sequences=2)
    for s in range(3):
        lm.logits(s, [1, 2, 3], 1)
    assert len(lm) == 2 and lm.cached_ids(0) is None
    assert lm.release(2) and not lm.release(2)
    assert len(lm) == 1


def test_out_of_range_token_ids_are_a_clear_error(tiny_lm):
    import pytest

    lm = CachedCausalLM(tiny_lm)
    for bad in ([1, 97], [-1, 2]):
        with pytest.raises(ValueError, match=r"\[0, 97\)"):
            lm.logits(1, bad, 1)


def test_batches_split_where_padding_would_more_than_double_the_cached_positions(tiny_lm):
    """One long sequence among short ones runs in its own forward (else every row is padded to its length); results
    still equal each sequence's own full forward."""
    import random

    rng = random.Random(1)
    lm = CachedCausalLM(tiny_lm, max_sequences=8, max_batched_new_tokens=400, max_padded_positions=256)
    sizes = []
    forward_batch = lm._forward_batch
    lm._forward_batch = lambda batch: sizes.append(sorted(b[4] for b in batch)) or forward_batch(batch)
    seqs = {0: 300, 1: 70, 2: 80, 3: 90}
    seqs = {s: [rng.randrange(97) for _ in range(n)] for s, n in seqs.items()}
    for s, ids in seqs.items():
        lm.logits(s, ids, 1)
    for _ in range(2):
        for ids in seqs.values():
            ids.append(rng.randrange(97))
        calls = [(s, list(ids), 1) for s, ids in seqs.items()]
        for (_, ids, n), got in zip(calls, lm.logits_batch(calls)):
            torch.testing.assert_close(got, _full_logits(tiny_lm, ids)[-n:], atol=1e-5, rtol=1e-4)
    # the three short ones share a forward; the 300-token one (4 x 301 - 541 = 663 padded slots > 256) runs alone
    assert [len(x) for x in sizes] == [3, 3] and all(max(x) < 100 for x in sizes)
    groups = lm._groups([(i, i, None, None, c, 1) for i, c in enumerate([10, 500, 20, 520, 30, 200])])
    assert [[r[4] for r in g] for g in groups] == [[10, 20, 30], [200], [500, 520]]  # 4 x 200 - 260 = 540 > 256


def test_kv_buffers_grow_and_roll_back_in_place(tiny_lm):
    """A sequence growing past its buffers' capacity (initial length + 256) in small steps, with rollbacks on the way,
    still gets the logits of a full forward; only the new positions are computed each time."""
    import random

    rng = random.Random(2)
    lm = CachedCausalLM(tiny_lm, max_sequences=2)
    ids = [rng.randrange(97) for _ in range(10)]
    lm.logits(1, ids, 1)
    capacity = lm._entries[1].slots.keys[0].shape[1]
    while len(ids) < capacity + 20:
        if rng.random() < 0.3:
            del ids[-rng.randint(1, 3):]  # a rejected draft: the next call overwrites from the common prefix
        ids += [rng.randrange(97) for _ in range(rng.randint(1, 6))]
        lm.logits(1, ids, 1)
    assert lm._entries[1].slots.keys[0].shape[1] > capacity
    torch.testing.assert_close(lm.logits(1, ids, 3), _full_logits(tiny_lm, ids)[-3:], atol=1e-5, rtol=1e-4)


def test_models_with_sliding_window_layers_are_refused(tiny_lm):
    import copy

    model = copy.deepcopy(tiny_lm)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="full-attention"):
        CachedCausalLM(model)


def test_a_sequence_longer_than_the_model_s_positions_is_refused(tiny_lm):
    from spec_decode.settings import InvalidInputError

    lm = CachedCausalLM(tiny_lm)
    assert lm.max_positions == tiny_lm.config.max_position_embeddings
    with pytest.raises(InvalidInputError, match="'token_ids': 1025 tokens .* at most 1024 positions"):
        lm.logits(1, [1] * 1025, 1)
    assert len(lm) == 0  # refused before any cache was made
