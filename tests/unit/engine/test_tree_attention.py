"""Draft trees in the engine (spec_decode.engine.paged_forward's tree mask, spec_decode.engine.tree_slots): each
node's logits are those of its own path scored as a chain, and the next round keeps the accepted path's keys and
values, so what follows equals an uncached forward."""

import random

import pytest
import torch

from spec_decode.engine import dtype_choice
from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.paged_forward import ancestors
from spec_decode.engine.tree_slots import row_parents
from spec_decode.tree import check_tree, path_tokens

# a tree of 7 nodes under the last committed token: two root-level branches, one of them forked twice
TOKENS = [5, 9, 11, 17, 23, 29, 31]
PARENTS = [-1, -1, 0, 0, 1, 3, 3]


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_ancestors_by_doubling_are_each_nodes_path():
    parents = torch.tensor([row_parents(8, PARENTS)])
    anc = ancestors(parents)[0]
    want = torch.zeros(8, 8, dtype=torch.bool)
    full = row_parents(8, PARENTS)
    for q in range(8):
        j = q
        while j >= 0:
            want[q, j] = True
            j = full[j]
    assert torch.equal(anc, want)


@pytest.mark.parametrize("batched", [False, True])
def test_each_node_is_scored_as_its_path_and_the_accepted_path_is_kept(tiny_lm, batched):
    """Row i + 1 of a tree round = the logits after node i's path scored alone (float32 agreement), beside another
    sequence or alone; the next round over committed + an accepted path that is not the first branch reuses the
    moved keys and values (only the new tokens are computed) and matches an uncached forward."""
    rng = random.Random(0)
    v = tiny_lm.config.vocab_size
    prompt = [rng.randrange(v) for _ in range(40)]
    check_tree(TOKENS, PARENTS)
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=16)
    lm.logits(1, prompt, 1)  # the prompt cached but its last token
    calls = [(1, prompt + TOKENS, len(TOKENS) + 1, PARENTS)]
    if batched:
        other = [rng.randrange(v) for _ in range(25)]
        calls.append((2, other + [3, 4], 3))
    out = lm.logits_batch(calls)
    rows = out[0].float()
    for j, path in enumerate(path_tokens(TOKENS, PARENTS)):
        torch.testing.assert_close(rows[j], _reference(tiny_lm, prompt + path), atol=2e-4, rtol=2e-4)
    assert lm.cached_ids(1) == prompt  # the tree is not part of what the sequence holds
    # accepted: nodes 1 -> 4 (tokens 9, 23), then a bonus token 7 and two new drafts
    nxt = prompt + [9, 23, 7, 8, 6]
    reused: list[int] = []
    (logits,) = lm.logits_batch([(1, nxt, 3)], reused=reused)
    assert reused == [len(prompt) + 2]  # the accepted path's two nodes were kept
    for j in range(3):
        torch.testing.assert_close(logits[j].float(), _reference(tiny_lm, nxt[: len(nxt) - 2 + j]), atol=2e-4,
                                   rtol=2e-4)


def test_a_tree_whose_path_was_not_followed_is_rolled_back(tiny_lm):
    rng = random.Random(1)
    v = tiny_lm.config.vocab_size
    prompt = [rng.randrange(v) for _ in range(20)]
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=4)
    lm.logits_batch([(1, prompt + TOKENS, len(TOKENS) + 1, PARENTS)])
    nxt = prompt + [40, 41]  # no node accepted: the recovered token 40, then a plain step
    reused: list[int] = []
    (logits,) = lm.logits_batch([(1, nxt, 1)], reused=reused)
    assert reused == [len(prompt)]
    torch.testing.assert_close(logits[0].float(), _reference(tiny_lm, nxt), atol=2e-4, rtol=2e-4)


def test_bad_trees_are_refused(tiny_lm):
    lm = CachedCausalLM(tiny_lm, max_sequences=2)
    with pytest.raises(ValueError, match="rows"):
        lm.logits_batch([(1, [1, 2, 3, 4], 2, [-1, 0])])


@pytest.mark.skipif(not dtype_choice.kernels_batch_invariant(torch.bfloat16),
                    reason="this CPU's bfloat16 kernels are not batch-invariant (auto serves float32)")
def test_bfloat16_tree_rows_equal_plain_decoding_bit_for_bit(tiny_lm):
    """In bfloat16 (the batch-invariant forward), a tree node's logits are bit for bit plain decoding's of its path,
    across the attention's key-block edge: greedy verification of a tree is exactly the target's greedy decoding."""
    import copy

    model = copy.deepcopy(tiny_lm).to(torch.bfloat16)
    rng = random.Random(2)
    for ctx in (40, 509):
        prompt = [rng.randrange(97) for _ in range(ctx)]
        lm = CachedCausalLM(model, max_sequences=2)
        assert lm.batch_invariant
        lm.logits(1, prompt, 1)
        rows = lm.logits_batch([(1, prompt + TOKENS, len(TOKENS) + 1, PARENTS)])[0]
        plain = CachedCausalLM(model, max_sequences=2)
        for j, path in enumerate(path_tokens(TOKENS, PARENTS)):
            assert torch.equal(plain.logits(2, prompt + path, 1)[0], rows[j]), (ctx, j)
