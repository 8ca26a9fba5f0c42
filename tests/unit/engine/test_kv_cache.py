"""spec_decode.engine.kv_cache over the paged KV pool (reuse, rollback, LRU, batched rounds at static shapes, padded
rows, eviction under the budget, shape selection, no host synchronisation), held against a plain transformers forward
of a tiny random Llama in float32."""

import random

import pytest
import torch

from spec_decode.engine.cuda_graphs import capture_shapes, smallest_shape
from spec_decode.engine.kv_cache import CachedCausalLM, KVCacheFull
from spec_decode.engine.paged_forward import FIELDS, RoundShape, pack_round, unpack_round


def _full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _close(got, model, ids):
    """Logits allclose to a full forward's and the same argmax."""
    want = _full_logits(model, ids)[-got.shape[0]:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cached_logits_equal_uncached_across_rollback(tiny_lm):
    lm = CachedCausalLM(tiny_lm, max_sequences=4)
    seq = [3, 14, 15, 92, 65, 35, 89, 79]
    _close(lm.logits(1, seq[:5], 1), tiny_lm, seq[:5])
    # Extend with "drafts", then roll back to a different continuation: the cache must crop to the common prefix.
    lm.logits(1, seq[:5] + [1, 2, 3], 4)
    alt = seq[:6] + [7, 7]
    _close(lm.logits(1, alt, 3), tiny_lm, alt)
    assert lm.cached_ids(1) == alt
    # Asking again for the last position of the cached tokens recomputes just that token.
    _close(lm.logits(1, alt, 1), tiny_lm, alt)


@pytest.mark.parametrize("mode", ["exact", "pad", "emulate"])
def test_batched_logits_equal_each_sequence_alone(tiny_lm, mode):
    """logits_batch over sequences with ragged contexts, k+1 query rows and rollbacks = full forwards; with
    ``pad_shapes`` the rounds run at bucketed batch and query sizes, and the padded rows and columns change nothing;
    with ``cuda_graphs: emulate`` the rounds that a CUDA graph would replay run the captured branch (the packing at a
    planned shape, padded rows and pages, all query rows returned and cut back) on this CPU."""
    rng = random.Random(0)
    lm = CachedCausalLM(tiny_lm, max_sequences=8, max_batched_new_tokens=6, max_tokens=4096, pad_shapes=mode == "pad",
                        cuda_graphs="emulate" if mode == "emulate" else "auto")
    shapes, captured = [], []
    forward = lm._forward

    def spy(rows):
        shape, graph = lm.round_shape(rows)
        shapes.append((len(rows), shape))
        captured.append(graph)
        return forward(rows)

    lm._forward = spy
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
        for (s, ids, _), got in zip(calls, lm.logits_batch(calls)):
            _close(got, tiny_lm, ids)
            assert lm.cached_ids(s) == ids
            assert not got.requires_grad  # no autograd graph kept alive by the caches (it grew without bound)
    batched = [n for n, _ in shapes if n > 1]
    assert len(batched) >= 5  # rounds after the prefills ran as one batched forward
    if mode == "pad":
        assert any(s.batch > n for n, s in shapes) and all(s.batch in (1, 2, 4, 8) for _, s in shapes)
        assert all(s.query in (1, 2, 3, 5, 9, 17) or s.query % 16 == 0 for _, s in shapes)
    if mode == "emulate":  # every round of up to 9 new positions replays a planned shape (512 or 1,024 positions)
        assert lm.graphs is not None and len(lm.graphs) == len(lm.graphs.shapes) > 0
        assert sum(captured) >= 5 and all(s.pages in (32, 64) for (_, s), c in zip(shapes, captured) if c)
        assert all(s.query > 9 for (_, s), c in zip(shapes, captured) if not c)  # prefills run eagerly
        assert any(s.batch > n for (n, s), c in zip(shapes, captured) if c)  # padded rows ran too
    else:
        assert not any(captured)
    with pytest.raises(ValueError, match="once per batch"):
        lm.logits_batch([(1, [1, 2], 1), (1, [1, 2], 1)])
    with pytest.raises(ValueError, match="token ids"):
        lm.logits_batch([(1, [1, 2], 1), (2, [1, 500], 1)])


def test_padded_rows_write_only_the_trash_page(tiny_lm):
    """A round padded to 4 rows and 5 query columns leaves every page but the trash page as a round of its real rows
    alone leaves it."""
    a = CachedCausalLM(tiny_lm, max_tokens=1024, prefix_caching=False)
    b = CachedCausalLM(tiny_lm, max_tokens=1024, prefix_caching=False, pad_shapes=True)
    calls = [(1, [5, 6, 7, 8], 1), (2, [9, 10, 11, 12, 13, 14], 3), (3, [1, 2], 2)]
    for lm in (a, b):
        lm.logits_batch(calls)
    ps = a.block_size
    for s, ids, _ in calls:
        assert a._seqs[s].pages == b._seqs[s].pages
        slots = [a._seqs[s].pages[p // ps] * ps + p % ps for p in range(len(ids))]
        torch.testing.assert_close(a.pool.data[:, :, :, slots], b.pool.data[:, :, :, slots], atol=1e-6, rtol=1e-5)
    assert b.round_shape([b._prepare(9, [1, 2, 3], 1, {9}).row])[0].query == 3


def test_cache_is_lru_bounded_and_released(tiny_lm):
    lm = CachedCausalLM(tiny_lm, max_sequences=2, max_tokens=1024)
    for s in range(3):
        lm.logits(s, [1, 2, 3], 1)
    assert len(lm) == 2 and lm.cached_ids(0) is None
    assert lm.release(2) and not lm.release(2)
    assert len(lm) == 1


def test_out_of_range_token_ids_are_a_clear_error(tiny_lm):
    lm = CachedCausalLM(tiny_lm, max_tokens=1024)
    for bad in ([1, 97], [-1, 2]):
        with pytest.raises(ValueError, match=r"\[0, 97\)"):
            lm.logits(1, bad, 1)


def test_batches_split_where_padding_would_more_than_double_the_cached_positions(tiny_lm):
    """One long sequence among short ones runs in its own forward (else every row reads its length); results still
    equal each sequence's own full forward."""
    rng = random.Random(1)
    lm = CachedCausalLM(tiny_lm, max_sequences=8, max_batched_new_tokens=400, max_padded_positions=256,
                        max_tokens=4096)
    sizes = []
    forward = lm._forward
    lm._forward = lambda rows: sizes.append(sorted(r.cached for r in rows)) or forward(rows)
    seqs = {0: 300, 1: 70, 2: 80, 3: 90}
    seqs = {s: [rng.randrange(97) for _ in range(n)] for s, n in seqs.items()}
    for s, ids in seqs.items():
        lm.logits(s, ids, 1)
    sizes.clear()
    for _ in range(2):
        for ids in seqs.values():
            ids.append(rng.randrange(97))
        calls = [(s, list(ids), 1) for s, ids in seqs.items()]
        for (_, ids, _), got in zip(calls, lm.logits_batch(calls)):
            _close(got, tiny_lm, ids)
    # the three short ones share a forward; the 300-token one (4 x 302 - 546 = 662 padded slots > 256) runs alone
    assert sorted(len(x) for x in sizes) == [1, 1, 3, 3] and all(max(x) < 100 for x in sizes if len(x) == 3)


def test_pages_grow_and_roll_back_without_moving_data(tiny_lm):
    """A sequence growing over many pages in small steps, with rollbacks on the way: a rollback keeps the page list's
    prefix (no data moves) and returns the pages wholly beyond it to the pool; the logits stay a full forward's."""
    rng = random.Random(2)
    lm = CachedCausalLM(tiny_lm, max_sequences=2, max_tokens=1024, prefix_caching=False)
    ids = [rng.randrange(97) for _ in range(10)]
    lm.logits(1, ids, 1)
    while len(ids) < 200:
        before = list(lm._seqs[1].pages)
        if rng.random() < 0.3:
            del ids[-rng.randint(1, 3):]  # a rejected draft: the next call overwrites from the common prefix
        ids += [rng.randrange(97) for _ in range(rng.randint(1, 6))]
        lm.logits(1, ids, 1)
        pages = lm._seqs[1].pages
        assert len(pages) == -(-len(ids) // lm.block_size)
        kept = min(len(before), len(pages)) - 1
        assert pages[:kept] == before[:kept]
        assert lm.allocated_tokens() == len(pages) * lm.block_size  # nothing else held (no prefix caching)
    _close(lm.logits(1, ids, 3), tiny_lm, ids)


def test_eviction_under_the_budget_keeps_outputs_exact(tiny_lm):
    """A pool of 64 positions and three sequences of 30: the least recently used sequence outside the round loses its
    pages (its next call recomputes it, exactly); a round that cannot fit even alone is a clear error."""
    rng = random.Random(4)
    lm = CachedCausalLM(tiny_lm, max_tokens=64, block_size=16, prefix_caching=False)
    seqs = {s: [rng.randrange(97) for _ in range(30)] for s in range(3)}
    for s, ids in seqs.items():
        _close(lm.logits(s, ids, 1), tiny_lm, ids)
        assert lm.allocated_tokens() <= 64
    assert lm.cached_ids(0) is None and lm.cached_ids(2) is not None  # 0 was evicted for 2
    for s, ids in seqs.items():
        ids.append(rng.randrange(97))
        _close(lm.logits(s, ids, 1), tiny_lm, ids)
    with pytest.raises(KVCacheFull, match="kv_cache_max_tokens"):
        lm.logits_batch([(s, ids + [1], 1) for s, ids in seqs.items()])
    with pytest.raises(KVCacheFull):
        lm.logits(7, [1] * 70, 1)
    _close(lm.logits(1, seqs[1] + [5], 1), tiny_lm, seqs[1] + [5])  # serving goes on


def test_models_with_sliding_window_layers_are_refused(tiny_lm):
    import copy

    model = copy.deepcopy(tiny_lm)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="full-attention"):
        CachedCausalLM(model)


def test_a_sequence_longer_than_the_model_s_positions_is_refused(tiny_lm):
    from spec_decode.settings import InvalidInputError

    lm = CachedCausalLM(tiny_lm, max_tokens=2048)
    assert lm.max_positions == tiny_lm.config.max_position_embeddings
    with pytest.raises(InvalidInputError, match="'token_ids': 1025 tokens .* at most 1024 positions"):
        lm.logits(1, [1] * 1025, 1)
    assert len(lm) == 0  # refused before any cache was made


def test_captured_shape_selection():
    """The round runs at the smallest captured shape that holds its batch, query length (and outputs) and pages;
    beyond every captured shape it runs eagerly."""
    shapes = capture_shapes((1, 2, 4, 8), (1, 2, 3, 5, 9), (32, 64))
    assert shapes[0] == RoundShape(8, 9, 9, 64) and len(shapes) == 40
    assert smallest_shape(shapes, 1, 1, 1, 10) == RoundShape(1, 1, 1, 32)
    assert smallest_shape(shapes, 3, 4, 4, 33) == RoundShape(4, 5, 5, 64)
    assert smallest_shape(shapes, 2, 1, 3, 1) == RoundShape(2, 3, 3, 32)  # 3 outputs need 3 query rows
    assert smallest_shape(shapes, 9, 1, 1, 1) is None and smallest_shape(shapes, 1, 10, 1, 1) is None
    assert smallest_shape(shapes, 1, 1, 1, 65) is None


def test_the_forward_has_no_host_synchronisation(tiny_lm):
    """The round's forward compiles as one graph (``torch.compile(fullgraph=True)``: a graph break, ``.item()`` or
    ``.tolist()`` inside would fail) and gives the eager forward's logits: what a CUDA graph can capture."""
    lm = CachedCausalLM(tiny_lm, max_tokens=1024, prefix_caching=False, pad_shapes=True)
    lm.logits_batch([(1, list(range(1, 20)), 1), (2, [4, 5, 6], 1)])
    rows = [lm._prepare(1, list(range(1, 20)) + [7, 8, 9], 4, {1, 2}).row,
            lm._prepare(2, [4, 5, 6, 7], 1, {1, 2}).row]
    shape, _ = lm.round_shape(rows)
    inputs = unpack_round(torch.from_numpy(pack_round(rows, shape, lm.block_size)), shape)
    compiled = torch.compile(lm._forward_fn.__call__, fullgraph=True, backend="eager")
    with torch.inference_mode():
        eager_logits, _ = lm._forward_fn.run(inputs)
        logits, hidden = compiled(*(inputs[f] for f in FIELDS))
    torch.testing.assert_close(logits, eager_logits)
    _close(logits[0, :4], tiny_lm, list(range(1, 20)) + [7, 8, 9])
    assert hidden.shape == (shape.batch, shape.outputs, tiny_lm.config.hidden_size)


@pytest.mark.parametrize("tree", [None, [-1, 0, 0]])
def test_the_forward_makes_no_tensor_off_its_device(tiny_lm, tree):
    """The round's forward run with its model, pool and inputs on the ``meta`` device (shapes only, no data): a
    tensor made inside it without ``device=`` (on the CPU) would meet a meta tensor and fail, as it would cost an
    upload (or fail) on CUDA. A chain round and a tree round (the ancestor mask built from parents)."""
    from transformers import LlamaForCausalLM

    host = CachedCausalLM(tiny_lm, max_tokens=1024, prefix_caching=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_lm.config).eval()
    meta = CachedCausalLM(model, max_tokens=1024, prefix_caching=False)
    assert meta.device.type == "meta" and meta.pool.data.device.type == "meta"
    host.logits_batch([(1, list(range(1, 20)), 1), (2, [4, 5, 6], 1)])
    rows = [host._prepare(1, list(range(1, 20)) + [7, 8, 9], 4, {1, 2}, tree).row,
            host._prepare(2, [4, 5, 6, 7], 1, {1, 2}).row]
    shape, _ = host.round_shape(rows)
    assert shape.tree == (tree is not None)
    inputs = unpack_round(torch.from_numpy(pack_round(rows, shape, host.block_size)).to("meta"), shape)
    with torch.inference_mode():
        logits, hidden = meta._forward_fn.run(inputs)
    assert logits.device.type == "meta" and logits.shape == (2, shape.outputs, tiny_lm.config.vocab_size)
