"""Batch invariance of the CPU forward (spec_decode.engine.invariant_attention, the engine's row padding) and what
``dtype: auto`` serves (spec_decode.engine.dtype_choice): a position's logits are the same bit for bit whether it is
scored alone, among k+1 positions of its sequence, or beside other sequences, in float32 and bfloat16 attention and
in bfloat16 for a whole model, the embedded one included."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from spec_decode.engine import dtype_choice
from spec_decode.engine.dtype_choice import DtypeChoice, choose_dtype, cpu_bf16_flag, probe_forward
from spec_decode.engine.invariant_attention import KEY_BLOCK, NAME, invariant_attention
from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.paged_forward import RoundRow

# where this CPU's bfloat16 kernels fail the check, dtype auto serves float32 and these tests have nothing to hold
BF16_INVARIANT = pytest.mark.skipif(not dtype_choice.kernels_batch_invariant(torch.bfloat16),
                                    reason="this CPU's bfloat16 kernels are not batch-invariant (auto serves float32)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=BF16_INVARIANT)]


def _mask(ctx: int, n: int, dtype) -> torch.Tensor:
    pos = torch.arange(ctx, ctx + n)
    return torch.where(torch.arange(ctx + n)[None] <= pos[:, None], 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_do_not_depend_on_the_other_rows(dtype):
    """Rows of a forward of n positions = the same positions one at a time, bit for bit, across key-block edges
    (contexts just below and above KEY_BLOCK), for 2 to 40 rows; and close to PyTorch's own attention."""
    gen = torch.Generator().manual_seed(0)
    for ctx in (7, KEY_BLOCK - 3, KEY_BLOCK + 1, 700):
        k = torch.randn(1, 2, ctx + 40, 16, generator=gen).to(dtype)
        v = torch.randn(1, 2, ctx + 40, 16, generator=gen).to(dtype)
        q = torch.randn(1, 6, 40, 16, generator=gen).to(dtype)
        for n in (2, 5, 17, 40):
            keys, values = k[:, :, : ctx + n], v[:, :, : ctx + n]
            full, _ = invariant_attention(None, q[:, :, :n], keys, values, _mask(ctx, n, dtype))
            ref = F.scaled_dot_product_attention(q[:, :, :n], k[:, :, : ctx + n], v[:, :, : ctx + n],
                                                 attn_mask=_mask(ctx, n, dtype), enable_gqa=True).transpose(1, 2)
            torch.testing.assert_close(full.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 2e-2,
                                       rtol=1e-4 if dtype == torch.float32 else 2e-2)
            for j in (0, n // 2, n - 1):
                one, _ = invariant_attention(None, q[:, :, j : j + 1], k[:, :, : ctx + j + 1], v[:, :, : ctx + j + 1],
                                             _mask(ctx + j, 1, dtype))
                assert torch.equal(one[:, 0], full[:, j]), (ctx, n, j)


def test_attention_refuses_dropout():
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="dropout"):
        invariant_attention(None, q, q, q, None, dropout=0.1)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_lm):
    return copy.deepcopy(tiny_lm).to(torch.bfloat16)


@BF16_INVARIANT
def test_bfloat16_engine_is_batch_invariant_on_a_cpu(tiny_bf16):
    """On a CPU in bfloat16 the engine turns batch invariance on (auto), switches the model's attention, pads a
    one-row round to two rows, and gives each position the logits of plain decoding: k+1 positions in one forward, and
    several sequences' rows in one round, equal one position per forward bit for bit."""
    lm = CachedCausalLM(copy.deepcopy(tiny_bf16), max_sequences=8, max_tokens=4096)
    assert lm.batch_invariant and lm.model.config._attn_implementation == NAME
    shape, _ = lm.round_shape([RoundRow([1], 0, [5], 1)])
    assert (shape.query, shape.outputs) == (2, 2)
    assert probe_forward(lm, positions=9, context=40) == 0
    rng = random.Random(0)
    seqs = {s: [rng.randrange(97) for _ in range(rng.randint(20, 600))] for s in range(4)}
    plain = CachedCausalLM(copy.deepcopy(tiny_bf16), max_sequences=8, max_tokens=4096, prefix_caching=False)
    for s, ids in seqs.items():
        lm.logits(s, ids, 1)
    drafts = {s: [rng.randrange(97) for _ in range(rng.randint(1, 8))] for s in seqs}
    got = lm.logits_batch([(s, ids + drafts[s], len(drafts[s]) + 1) for s, ids in seqs.items()])
    for (s, ids), rows in zip(seqs.items(), got):
        for j in range(len(drafts[s]) + 1):
            want = plain.logits(100 + s, ids + drafts[s][:j], 1)[0]
            assert torch.equal(rows[j], want), (s, j)


def test_float32_keeps_pytorchs_attention(tiny_lm):
    lm = CachedCausalLM(copy.deepcopy(tiny_lm), max_tokens=4096)
    assert not lm.batch_invariant and lm.model.config._attn_implementation != NAME
    assert lm.round_shape([RoundRow([1], 0, [5], 1)])[0].query == 1


@BF16_INVARIANT
def test_the_embedded_model_in_bfloat16_is_batch_invariant(real_model):
    """The real SmolLM2-135M in bfloat16 (30 layers, grouped-query attention, a 49,152-token head): 9 positions in one
    forward on a 300-token context = nine one-position forwards, bit for bit."""
    lm = CachedCausalLM(copy.deepcopy(real_model).to(torch.bfloat16), max_sequences=4, max_tokens=2048)
    assert probe_forward(lm, positions=9, context=300) == 0


@BF16_INVARIANT
def test_the_embedded_models_tree_rounds_are_plain_decoding_in_bfloat16(real_model_dir, real_tokenizer):
    """n-gram trees on the real model in bfloat16 (HumanEval prompt 4, whose trees have nodes with a masked cousin
    slot before them): every tree round's node logits are plain decoding's of its path, bit for bit, and the output
    is plain decoding's. Under the tree mask alone the masked slot shifted later keys' partial sums (a logit 0.375 off
    at the first tree, the output different from its 22nd token); each path attended to as a chain
    (invariant_attention.TreePaths) cures it."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.model_loading import load_causal_lm
    from spec_decode.engine.scorer import TargetScorer
    from spec_decode.generation import Generation
    from spec_decode.in_process import LocalStep, run_local
    from spec_decode.proposers.ngram import NgramProposer
    from spec_decode.request import GenerationRequest
    from spec_decode.tree import path_tokens

    model = load_causal_lm(real_model_dir, torch.device("cpu"), torch.bfloat16)  # as target_model loads it
    prompt = real_tokenizer(humaneval_prompts(5)[4])["input_ids"]
    plain = CachedCausalLM(model, max_sequences=4, max_tokens=4096)
    trees = 0

    def run(method: str, lm: CachedCausalLM) -> list[int]:
        req = GenerationRequest("x", 40, speculative_method=method, num_draft_tokens=8, draft_tree=True)
        gen = Generation(1, prompt, req, real_tokenizer, [real_tokenizer.eos_token_id], 4096, 0)
        run_local(gen, LocalStep({"ngram": NgramProposer()}, TargetScorer(lm)))
        return gen.output_ids

    lm = CachedCausalLM(model, max_sequences=4, max_tokens=4096)
    scored = lm.logits_batch

    def checked(calls, **kw):  # every tree row against plain decoding of its path
        nonlocal trees
        out = scored(calls, **kw)
        for (_, ids, n, *tree), res in zip(calls, out):
            if tree and tree[0] is not None:
                trees += 1
                base = ids[: len(ids) - n + 1]
                for j, path in enumerate(path_tokens(ids[len(base):], tree[0])):
                    assert torch.equal((res[0] if kw.get("hidden") else res)[j], plain.logits(9, base + path, 1)[0])
        return out

    lm.logits_batch = checked
    assert run("ngram", lm) == run("none", CachedCausalLM(model, max_sequences=4, max_tokens=4096))
    assert trees > 0


def test_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n"
                    "flags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_flag(info) == "amx_bf16"
    info.write_text("flags\t\t: fpu sse avx512f avx512_bf16\n")
    assert cpu_bf16_flag(info) == "avx512_bf16"
    info.write_text("flags\t\t: fpu sse avx2\n")
    assert cpu_bf16_flag(info) is None
    assert cpu_bf16_flag(tmp_path / "missing") is None


def test_auto_picks_bfloat16_only_where_native_and_invariant(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_dtype("auto", cuda) == DtypeChoice(torch.bfloat16, "auto: a GPU")
    none = choose_dtype("auto", cpu, cpu_flag="")
    assert none.dtype == torch.float32 and "no native bfloat16" in none.reason
    monkeypatch.setattr(dtype_choice, "kernels_batch_invariant", lambda dtype=None: True)
    amx = choose_dtype("auto", cpu, cpu_flag="amx_bf16")
    assert amx.dtype == torch.bfloat16 and "amx_bf16" in str(amx) and str(amx).startswith("bfloat16 (auto: ")
    monkeypatch.setattr(dtype_choice, "kernels_batch_invariant", lambda dtype=None: False)
    varies = choose_dtype("auto", cpu, cpu_flag="avx512_bf16")
    assert varies.dtype == torch.float32 and "not batch-invariant" in varies.reason
    assert choose_dtype("bfloat16", cpu).dtype == torch.bfloat16  # served as asked, with a warning
    assert choose_dtype("float32", cuda) == DtypeChoice(torch.float32, "asked for")
    with pytest.raises(KeyError):
        choose_dtype("float64", cpu)


@BF16_INVARIANT
def test_this_machines_kernels_are_checked():
    """The kernel check agrees with a direct look at a product it does not make: bfloat16 rows of 1,536 -> 576
    products over 2-40 rows, other data, equal those rows among 64."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(576, 1536, generator=gen).bfloat16()
    x = torch.randn(64, 1536, generator=gen).bfloat16()
    full = F.linear(x, w)
    assert all(torch.equal(F.linear(x[:m], w), full[:m]) for m in (2, 7, 40))
