"""The EAGLE head's paged contexts (proposers/eagle/context.py) against dense per-context attention."""

import random

import torch
import torch.nn.functional as F

from spec_decode.proposers.eagle.context import PAGE_SIZE, EagleContext, HeadKV


def _attend(q, keys, values, mask):
    att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return att.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def test_paged_rows_equal_dense_attention_through_growth_rollbacks_and_releases():
    heads, kv_heads, d = 4, 2, 8
    kv = HeadKV(kv_heads, d, torch.float32, torch.device("cpu"), initial_pages=2)  # one usable page: it must double
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    ctxs = [EagleContext() for _ in range(3)]
    dense = [(torch.empty(kv_heads, 0, d), torch.empty(kv_heads, 0, d)) for _ in ctxs]
    for step in range(12):
        live = rng.sample(range(3), rng.randint(1, 3))
        ts = [rng.randint(1, 2 * PAGE_SIZE + 3) if step < 2 else rng.randint(1, 5) for _ in live]
        n = sum(ts)
        q = torch.randn(1, heads, n, d, generator=gen)
        k, v = torch.randn(1, kv_heads, n, d, generator=gen), torch.randn(1, kv_heads, n, d, generator=gen)
        got = kv.attend_rows(_attend, q, k, v, [(ctxs[i], t) for i, t in zip(live, ts)])
        at = 0
        for i, t in zip(live, ts):
            c = ctxs[i].length
            keys = torch.cat([dense[i][0][:, :c], k[0, :, at : at + t]], 1)
            values = torch.cat([dense[i][1][:, :c], v[0, :, at : at + t]], 1)
            mask = torch.ones(t, c + t, dtype=torch.bool).tril(c)[None, None]
            want = _attend(q[:, :, at : at + t], keys[None], values[None], mask)[0]
            torch.testing.assert_close(got[at : at + t], want)
            dense[i] = (keys, values)
            keep = rng.randint(max(0, c + t - 4), c + t)  # a rollback: some new pairs rejected
            kv.cut(ctxs[i], keep)
            dense[i] = (keys[:, :keep], values[:, :keep])
            assert len(ctxs[i].pages.pages) == -(-keep // PAGE_SIZE)
            at += t
    assert kv.pool.num_pages > 2 and kv.blocks.num_pages == kv.pool.num_pages
    for ctx in ctxs:
        kv.release(ctx)
    assert kv.blocks.used_pages() == 0


def test_grouped_attention_expanded_for_cuda_equals_the_grouped_call():
    """The EAGLE heads' attention: the form CUDA runs (keys and values expanded to the query heads, no enable_gqa:
    the memory-efficient kernel takes it with a boolean mask) computes what the grouped call computes."""
    from spec_decode.proposers.eagle.model import gqa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8,
                                                                                                      generator=g)
    mask = torch.rand(2, 1, 3, 5, generator=g) > 0.4
    mask[..., 0] = True
    grouped = gqa_attention(q, k, v, mask, expand=False)
    assert grouped.shape == (2, 3, 32)
    torch.testing.assert_close(gqa_attention(q, k, v, mask, expand=True), grouped, atol=1e-6, rtol=1e-6)
