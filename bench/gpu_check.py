"""The GPU check (``make gpu-check``): the verifier's Triton kernels and the served models' CUDA path, in minutes.

    python3 bench/gpu_check.py [--device auto|cuda|cpu] [--output results/gpu_check.json]

Made for a GPU machine lent for minutes, with no network and no tritonserver: it needs only torch, triton,
transformers and numpy (checked with Python 3.12, torch 2.11, triton 3.6, transformers 5.17 as well as with the
versions in requirements.txt), installs nothing and downloads nothing. It writes one JSON and prints a short table;
the exit status is 1 when a check fails.

1. ``kernels``: the Triton kernels against the torch path on the same device, fed the same noise (uniform accept
   draws and the exponential race as tensors), for V in {49152, 128256, 151936}, k in {1, 4, 8}, B in {1, 8, 64},
   float32 and bfloat16: rejection sampling with and without draft probabilities and typical acceptance, greedy and
   sampled rows, outputs equal token for token. Then: a distribution test of the kernels' own (Philox) randomness
   (the first emitted token follows the target's distribution, and so do the next one after an accepted draft and
   the bonus token after k accepted drafts: chi-square over 2^20 rows); a batch of more than 2^31 elements
   (B x (k+1) x V, bfloat16: 64-bit offsets) against the torch path; seeded rows batch-invariant (a row alone, in
   its batch, and in the batch reversed gives the same tokens, on both paths).
2. ``bandwidth``: the verifier at B = 64, k = 5, V = 128256 (draft probabilities, sampled and greedy rows, float32
   and bfloat16): bytes of probabilities per second against the device's copy bandwidth measured in the same run
   (a 1 GiB device-to-device copy, read + write), for the kernel launch, the public ``rejection_sample`` on each
   backend and the torch maths alone. Two byte counts: the tensors' size (target [B, k+1, V] + draft [B, k, V]), and
   what the kernel must read (per row the position it samples from, plus every drafted position's row for greedy
   rows).
3. ``decoding``: speculative decoding in process (:class:`spec_decode.serving.local_ensemble.LocalEnsemble`: the
   three served backends, rows stacked and padded as the Triton ensemble passes them) with a Llama-architecture target
   of about 1.2B parameters with random weights (16 layers, hidden 2048, vocabulary 128256; the embedded default model
   does not travel to the GPU machine) and a 2-layer draft (the target's first two layers, embeddings and head: an
   early-exit draft), greedy, k = 4: in float32, every method's output (none, draft, ngram, suffix, and the target
   drafting for itself) at batch 1 and 8 must equal the target's plain greedy decoding by transformers' ``generate``
   token for token; in bfloat16 the same comparison is reported (a divergence at a near-tie of the reference's two
   best logits is counted as such: bfloat16's rounding differs between a 1-position and a k+1-position forward) with
   the tokens/s of each method at batch 1 and 8, the acceptance rate and mean tokens per step. Then the forward cost
   of 1-9 new positions on a 300-token cache (bfloat16 target), against one position.

``--device cpu`` (the default when CUDA is not available) runs the same code at tiny sizes, the kernels under
``TRITON_INTERPRET=1``: ``make test`` runs it, so the script cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cuda: the full check; cpu: tiny sizes, kernels under TRITON_INTERPRET=1 (auto: cuda if any)")
    ap.add_argument("--output", type=Path, default=ROOT / "results" / "gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which the decoding part's remaining runs are skipped (reported as skipped)")
    return ap.parse_args(argv)


ARGS = _parse(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
import torch  # noqa: E402

if ARGS.device == "auto":
    ARGS.device = "cuda" if torch.cuda.is_available() else "cpu"
    if ARGS.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("gpu_check: CPU mode needs TRITON_INTERPRET=1 before triton is imported: use --device cpu")
        os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(ROOT / "backend_src"))

import numpy as np  # noqa: E402

from spec_decode.verifier import rejection_sample, typical_acceptance_sample  # noqa: E402
from spec_decode.verifier.kernels import rejection_triton, typical_triton  # noqa: E402
from spec_decode.verifier.rejection import TYPICAL_ALPHA, TYPICAL_EPSILON  # noqa: E402
from spec_decode.verifier.torch_impl import rejection_torch, typical_torch  # noqa: E402

CUDA = ARGS.device == "cuda"
DEV = torch.device("cuda" if CUDA else "cpu")
torch.set_float32_matmul_precision("highest")  # float32 GEMMs in IEEE float32 (no TF32): the exact greedy check
EPS, ALPHA = TYPICAL_EPSILON, TYPICAL_ALPHA  # typical acceptance's defaults

# Sizes: the full ones on CUDA; tiny on CPU (the interpreter runs a program in numpy, one at a time).
if CUDA:
    VOCABS, KS, BATCHES, DTYPES = (49152, 128256, 151936), (1, 4, 8), (1, 8, 64), (torch.float32, torch.bfloat16)
    DIST_ROWS, DIST_V, DIST_K = 1 << 20, 16, 3
    BIG_V, BIG_K = 151936, 8
    BIG_B = 2**31 // (BIG_K * BIG_V) + 2  # B x k x V (draft) and B x (k+1) x V (target) > 2^31
    INVARIANCE = (64, 4, 128256)
    BANDWIDTH = (64, 5, 128256)
    LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
    PROMPTS, PROMPT_LEN, MAX_TOKENS, REPS = 8, 64, 48, 20
else:
    VOCABS, KS, BATCHES, DTYPES = (37, 5000), (1, 3), (1, 3), (torch.float32, torch.bfloat16)
    DIST_ROWS, DIST_V, DIST_K = 240, 4, 2
    BIG_V, BIG_K, BIG_B = 5000, 2, 3
    INVARIANCE = (5, 3, 300)
    BANDWIDTH = (4, 3, 5000)
    LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
    PROMPTS, PROMPT_LEN, MAX_TOKENS, REPS = 3, 24, 12, 3
K_DECODE = 4
VERIFIER_BACKEND = "auto"  # Triton kernels on CUDA; torch when Triton cannot build its launchers (see toolchain())
FORWARD_NEW_POSITIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
FORWARD_CACHE = 300

FAILURES: list[str] = []


def fail(msg: str) -> None:
    """Record a failed check (the run goes on; the exit status is 1)."""
    FAILURES.append(msg)
    print(f"FAIL: {msg}", flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up (device synchronised around each)."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def exponential(shape, gen) -> torch.Tensor:
    """Exp(1) noise > 0 (the race's E), float32 on DEV."""
    u = torch.rand(shape, generator=gen, device=DEV)
    return (-torch.log1p(-u)).clamp_min(1e-30)


def make_case(b: int, k: int, v: int, dtype, with_draft_probs: bool, gen, peak: float = 3.0):
    """Random verifier inputs: peaked target rows, draft rows near them, drafts drawn from the draft rows.

    Returns (target_probs [b, k+1, v] dtype, draft_token_ids [b, k] int64 with a -1 placeholder ending every fifth
    row's drafts when k > 1, draft_probs [b, k, v] dtype or None), on DEV."""
    logits = torch.randn((b, k + 1, v), generator=gen, device=DEV) * peak
    tp = torch.softmax(logits, -1)
    q = torch.softmax(logits[:, :k] + torch.randn((b, k, v), generator=gen, device=DEV), -1)
    ids = torch.argmax(q / exponential((b, k, v), gen), -1)  # x ~ q (exponential race)
    if k > 1:
        ids[4::5, -1] = -1
    dp = q.to(dtype) if with_draft_probs else None
    return tp.to(dtype), ids, dp


def check_output_shape(out: torch.Tensor, ids: torch.Tensor, tp: torch.Tensor, label: str) -> None:
    """Structure of a verifier output row: the accepted drafts, one token with p > 0, then -1."""
    b, k1 = out.shape
    n = (out >= 0).sum(-1) - 1
    pos = torch.arange(k1, device=out.device)[None]
    drafts = torch.cat([ids, ids.new_full((b, 1), -1)], 1)
    ok = torch.where(pos < n[:, None], out == drafts, torch.where(pos == n[:, None], out >= 0, out == -1))
    tok = out.gather(1, n[:, None])[:, 0]
    p_tok = tp[torch.arange(b, device=out.device), n, tok.clamp_min(0)]
    if not bool(ok.all()) or not bool((p_tok > 0).all()):
        fail(f"{label}: malformed output (accepted prefix, a token with p > 0, -1 after)")


# ---------------------------------------------------------------------------------------------------------------- 1
def kernels_vs_torch() -> dict:
    """Every (V, k, B, dtype): kernels == torch path with the same noise, for each sampler and row kind."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows, compared, equal = [], 0, 0
    for v in VOCABS:
        for k in KS:
            for b in BATCHES:
                for dtype in DTYPES:
                    seeds = torch.arange(b, dtype=torch.int64, device=DEV) + 1000
                    u = torch.rand((b, k), generator=gen, device=DEV)
                    e = exponential((b, v), gen)
                    for with_dp in (True, False):
                        tp, ids, dp = make_case(b, k, v, dtype, with_dp, gen)
                        for greedy_rows in (False, True):
                            greedy = torch.full((b,), greedy_rows, dtype=torch.bool, device=DEV)
                            kinds = [("rejection", partial(rejection_triton, tp, ids, dp, seeds, greedy, (u, e)),
                                      partial(rejection_torch, tp, ids, dp, u, e, greedy))]
                            if not with_dp:
                                kinds.append(("typical",
                                              partial(typical_triton, tp, ids, EPS, ALPHA, seeds, greedy, e),
                                              partial(typical_torch, tp, ids, EPS, ALPHA, e, greedy)))
                            for name, kernel, reference in kinds:
                                label = (f"{name} V={v} k={k} B={b} {str(dtype)[6:]} "
                                         f"{'draft probs' if with_dp else 'no draft probs'} "
                                         f"{'greedy' if greedy_rows else 'sampled'}")
                                try:
                                    got, want = kernel(), reference()
                                    same = bool(torch.equal(got, want))
                                except Exception as exc:  # noqa: BLE001 - reported as a failed check
                                    fail(f"{label}: {type(exc).__name__}: {exc}")
                                    continue
                                compared += 1
                                equal += same
                                if not same:
                                    rows_off = torch.nonzero((got != want).any(-1)).reshape(-1).tolist()
                                    fail(f"{label}: kernel != torch in rows {rows_off[:8]}")
                                check_output_shape(got, ids, tp, label)
                                accepted = float(((got >= 0).sum(-1) - 1).float().mean()) / k
                                rows.append({"sampler": name, "V": v, "k": k, "B": b, "dtype": str(dtype)[6:],
                                             "draft_probs": with_dp, "greedy": greedy_rows, "equal": same,
                                             "mean_accepted_fraction": round(accepted, 3)})
                            # The in-kernel Philox path (what serving runs): well-formed output.
                            out = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="triton")
                            check_output_shape(out, ids, tp, f"philox V={v} k={k} B={b}")
    print(f"kernels vs torch: {equal}/{compared} comparisons equal", flush=True)
    return {"compared": compared, "equal": equal, "cases": rows}


def _chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of ``observed`` counts against ``probs`` and its p-value (df = cells - 1)."""
    n = float(observed.sum())
    expected = probs.double().cpu() * n
    stat = float(((observed.double().cpu() - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p_value


def distribution() -> dict:
    """The kernels' own randomness: emitted tokens follow the target distribution (chi-square)."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    n, v, k = DIST_ROWS, DIST_V, DIST_K
    p = torch.softmax(torch.randn((k + 1, v), generator=gen, device=DEV), -1)
    q = torch.softmax(torch.randn((k, v), generator=gen, device=DEV), -1)
    ids = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()  # [n, k], x_i ~ q_i
    tp = p.expand(n, k + 1, v).contiguous()
    out = {}
    for with_dp in (True, False):
        dp = q.expand(n, k, v).contiguous() if with_dp else None
        seeds = torch.arange(n, dtype=torch.int64, device=DEV) + (0 if with_dp else n)
        got = rejection_sample(tp, ids, dp, seeds=seeds, backend="triton")
        tests = {}
        first = got[:, 0]
        tests["first token ~ p0"] = (first, p[0])
        after = got[:, 1][(first == ids[:, 0]) & (got[:, 1] >= 0)]  # draft 0 accepted: the next token ~ p1
        tests["token after an accepted draft ~ p1"] = (after, p[1])
        bonus = got[:, k][(got[:, :k] == ids).all(-1)]
        tests[f"bonus after {k} accepted ~ p{k}"] = (bonus, p[k])
        res = {}
        for name, (tokens, probs) in tests.items():
            counts = torch.bincount(tokens, minlength=v)
            stat, pv = _chi_square(counts, probs)
            res[name] = {"samples": int(counts.sum()), "chi2": round(stat, 2), "p_value": pv}
            if pv < 1e-6:
                fail(f"distribution ({'draft probs' if with_dp else 'no draft probs'}) {name}: p-value {pv:.2e}")
        out["draft probs" if with_dp else "no draft probs"] = res
    print(f"distribution: {json.dumps(out)}", flush=True)
    return {"rows": n, "V": v, "k": k, "tests": out}


def big_batch() -> dict:
    """B x (k+1) x V above 2^31 elements (bfloat16): the kernel (64-bit offsets) equals the torch path."""
    b, k, v = BIG_B, BIG_K, BIG_V
    gen = torch.Generator(device=DEV).manual_seed(3)
    tp = torch.empty((b, k + 1, v), dtype=torch.bfloat16, device=DEV)
    dp = torch.empty((b, k, v), dtype=torch.bfloat16, device=DEV)
    ids = torch.empty((b, k), dtype=torch.int64, device=DEV)
    for s in range(0, b, 64):  # fill in chunks (float32 temporaries stay small)
        t, i, d = make_case(min(64, b - s), k, v, torch.bfloat16, True, gen)
        tp[s:s + 64], ids[s:s + 64], dp[s:s + 64] = t, i, d
    del t, i, d
    seeds = torch.arange(b, dtype=torch.int64, device=DEV)
    greedy = torch.zeros(b, dtype=torch.bool, device=DEV)
    greedy[1::3] = True
    u = torch.rand((b, k), generator=gen, device=DEV)
    e = exponential((b, v), gen)
    got = rejection_triton(tp, ids, dp, seeds, greedy, (u, e))
    want = rejection_torch(tp, ids, dp, u, e, greedy)
    same = bool(torch.equal(got, want))
    if not same:
        fail(f"big batch B={b} k={k} V={v}: kernel != torch in rows "
             f"{torch.nonzero((got != want).any(-1)).reshape(-1).tolist()[:8]}")
    philox = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="triton")
    check_output_shape(philox, ids, tp, "big batch philox")
    res = {"B": b, "k": k, "V": v, "elements": b * (k + 1) * v, "above_2_31": b * (k + 1) * v > 2**31,
           "dtype": "bfloat16", "equal": same, "last_row_tokens": got[-1].tolist()}
    print(f"big batch: {res}", flush=True)
    del tp, dp, e
    if CUDA:
        torch.cuda.empty_cache()
    return res


def batch_invariance() -> dict:
    """A seeded row gives the same tokens alone, in its batch, and in the batch reversed (both backends)."""
    b, k, v = INVARIANCE
    gen = torch.Generator(device=DEV).manual_seed(4)
    tp, ids, dp = make_case(b, k, v, torch.float32, True, gen)
    seeds = torch.arange(b, dtype=torch.int64, device=DEV) * 7919 + 3
    res = {}
    backends = ("triton", "torch")
    for backend in backends:
        for name, run in (
            ("rejection", lambda sl, s, be: rejection_sample(tp[sl], ids[sl], dp[sl], seeds=s, backend=be)),
            ("typical", lambda sl, s, be: typical_acceptance_sample(tp[sl], ids[sl], seeds=s, backend=be)),
        ):
            whole = run(slice(None), seeds, backend)
            rev = torch.arange(b - 1, -1, -1, device=DEV)
            reversed_ = run(rev, seeds[rev], backend).flip(0)
            alone = torch.cat([run(slice(r, r + 1), seeds[r:r + 1], backend) for r in range(b)])
            same = bool(torch.equal(whole, reversed_)) and bool(torch.equal(whole, alone))
            res[f"{name} {backend}"] = same
            if not same:
                fail(f"seeded batch invariance: {name} on {backend} differs between a row alone and in its batch")
    print(f"batch invariance (B={b}, k={k}, V={v}): {res}", flush=True)
    return {"B": b, "k": k, "V": v, "invariant": res}


# ---------------------------------------------------------------------------------------------------------------- 2
def copy_bandwidth_gb_s(nbytes: int) -> float:
    """GB/s (1e9) of a device-to-device copy of ``nbytes`` (read + write counted), best of 10."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV).uniform_()
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(10):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def bench_seconds(fn, reps: int) -> float:
    """Median seconds of ``fn()``: on CUDA by ``triton.testing.do_bench`` (CUDA events, the L2 cache flushed before
    each run, so rows re-read across repeats come from memory as in serving), on CPU by :func:`timed`."""
    if not CUDA:
        return timed(fn, reps)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def bandwidth() -> dict:
    """The verifier's bytes per second at B = 64, k = 5, V = 128256 against the device's copy bandwidth."""
    from spec_decode.verifier.kernels import _block_v, rejection_kernel

    b, k, v = BANDWIDTH
    peak = copy_bandwidth_gb_s(1 << 30 if CUDA else 1 << 26)
    gen = torch.Generator(device=DEV).manual_seed(5)
    rows = []
    reps = REPS if CUDA else 2

    # the kernel alone: buffers ready, no flag check (no host sync)
    def launch(tp, dp, ids, seeds, greedy8, u, e, out, flags):
        rejection_kernel[(b,)](tp, dp, ids, seeds, greedy8, u, e, out, flags, k, v, HAS_DRAFT_PROBS=True,
                               HAS_NOISE=False, BLOCK_V=_block_v(v))

    for dtype in DTYPES:
        tp, ids, dp = make_case(b, k, v, dtype, True, gen)
        ids[ids < 0] = 0  # no placeholders here
        seeds = torch.arange(b, dtype=torch.int64, device=DEV)
        u, e = torch.rand((b, k), generator=gen, device=DEV), exponential((b, v), gen)
        elt = tp.element_size()
        tensor_bytes = (tp.numel() + dp.numel()) * elt
        out = torch.empty((b, k + 1), dtype=torch.int64, device=DEV)
        flags = torch.empty(b, dtype=torch.int32, device=DEV)
        for greedy_rows in (False, True):
            greedy = torch.full((b,), greedy_rows, dtype=torch.bool, device=DEV)
            greedy8 = greedy.to(torch.int8)
            n = ((rejection_triton(tp, ids, dp, seeds, greedy) >= 0).sum(-1) - 1).cpu()
            # What the kernel reads: the row it samples from (p, and q where a draft was rejected there), and for
            # greedy rows the target row of every position up to the first rejection (the argmax check).
            read_bytes = sum((1 + (int(m) < k) + (min(int(m) + 1, k) if greedy_rows else 0)) * v * elt for m in n)
            variants = {
                "kernel launch": (partial(launch, tp, dp, ids, seeds, greedy8, u, e, out, flags), read_bytes),
                "rejection_triton (+ flag check)": (partial(rejection_triton, tp, ids, dp, seeds, greedy), read_bytes),
                "rejection_sample(backend=triton)": (partial(
                    rejection_sample, tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="triton"), read_bytes),
                # the torch path reads the whole tensors (several passes): counted at their size
                "torch maths (noise given)": (partial(rejection_torch, tp, ids, dp, u, e, greedy), tensor_bytes),
                "rejection_sample(backend=torch)": (partial(
                    rejection_sample, tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="torch"), tensor_bytes),
            }
            if not CUDA:  # the interpreter's time means nothing: keep the CPU mode short
                variants = {name: fn for name, fn in variants.items() if "torch" in name}
            for name, (fn, counted) in variants.items():
                sec = bench_seconds(fn, reps)
                rows.append({"variant": name, "dtype": str(dtype)[6:], "greedy": greedy_rows, "seconds": sec,
                             "tensor_bytes": tensor_bytes, "kernel_read_bytes": read_bytes, "counted_bytes": counted,
                             "GB_per_s": counted / sec / 1e9, "fraction_of_copy": counted / sec / 1e9 / peak})
    for r in rows:
        print(f"  {r['variant']:<34}{r['dtype']:>9}{' greedy' if r['greedy'] else ' sampled':>9}"
              f"{r['seconds'] * 1e3:>9.3f} ms{r['GB_per_s']:>9.1f} GB/s ={100 * r['fraction_of_copy']:>6.1f}% of copy",
              flush=True)
    return {"B": b, "k": k, "V": v, "copy_GB_per_s": peak, "rows": rows,
            "bytes": "kernel rows: what the kernel reads (kernel_read_bytes); torch rows: the tensors' size"}


# ---------------------------------------------------------------------------------------------------------------- 3
def build_models(folder: Path) -> dict:
    """A random-weight Llama target, its 2-layer early-exit draft (bfloat16 model folders) and a random EAGLE head
    over half of its vocabulary (as ``make speculator`` saves one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec_decode.engine.draft_vocab import DraftVocab
    from spec_decode.engine.surgery import truncated_copy
    from spec_decode.proposers.eagle import EagleHead, eagle_config

    torch.manual_seed(0)
    cfg = LlamaConfig(**LLAMA, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    with torch.device(DEV):
        target = LlamaForCausalLM(cfg)
        draft = truncated_copy(target, 2)
    paths = {"target": folder / "target", "draft": folder / "draft", "eagle": folder / "eagle"}
    vocab = DraftVocab(torch.arange(0, LLAMA["vocab_size"], 2), LLAMA["vocab_size"])
    emb = target.get_input_embeddings().weight.detach()[vocab.token_ids.to(DEV)].cpu()
    head = target.get_output_embeddings().weight.detach()[vocab.token_ids.to(DEV)].cpu()
    EagleHead(torch.cat([emb, emb.mean(0, keepdim=True)]), head, eagle_config(cfg)).save(paths["eagle"], vocab)
    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.bfloat16).save_pretrained(paths[name])
    params = sum(p.numel() for p in target.parameters())
    del target, draft
    return {"paths": paths, "target_parameters": params}


def load_ensembles(paths: dict, dtype: str, verifier_backend: str) -> dict:
    """method -> LocalEnsemble: the served backends on DEV with ``dtype``; "self" drafts with the target itself."""
    from transformers.utils import logging as hf_logging

    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    hf_logging.disable_progress_bar()

    common = {"device": DEV.type, "dtype": dtype, "max_sequences": "64"}
    target = TargetBackend({**common, "model_path": str(paths["target"])})
    verifier = VerifierBackend({"num_threads": "0", "backend": verifier_backend})
    # the draft LMs draft every slot (a random-weight draft is never confident: the default 0.3 would draft nothing)
    suffix = {"suffix_backend": "python", "suffix_max_cached_requests": "64", "draft_min_token_prob": "0"}
    draft = DraftBackend({**common, **suffix, "draft_model_path": str(paths["draft"]),
                          "eagle_path": str(paths["eagle"]), "eagle_min_token_prob": "0"})
    self_draft = DraftBackend({**common, **suffix, "draft_model_path": str(paths["target"])})
    main = LocalEnsemble(draft, target, verifier)
    return {"none": main, "draft": main, "ngram": main, "suffix": main, "eagle": main,
            "self": LocalEnsemble(self_draft, target, verifier)}


class _SeqIds:
    next = 1


def decode(ensemble, method: str, prompts: list[list[int]], batch: int, max_tokens: int = MAX_TOKENS) -> dict:
    """Greedy decoding of ``prompts`` through ``ensemble``, ``batch`` sequences per round (lockstep, as generate's
    rounds), ``max_tokens`` each. The requests count as seeded, so suffix decoding drafts from each request's own tree
    only and no run learns from another's responses. Returns outputs, seconds, steps, drafted and accepted tokens."""
    from spec_decode.protocol import StepInputs
    from spec_decode.sampling import SamplingParams

    params = SamplingParams(0.0, 0, 1.0, 0, seeded=True)
    served = "draft" if method == "self" else method
    k = 0 if method == "none" else K_DECODE
    outputs, steps, drafted, accepted = [None] * len(prompts), 0, 0, 0
    sync()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        live = {}
        for i in range(first, min(first + batch, len(prompts))):
            live[i] = (_SeqIds.next, list(prompts[i]))
            _SeqIds.next += 1
        step = 0
        while live:
            order = list(live)
            inps = [StepInputs(live[i][0], live[i][1], k, served, params, step) for i in order]
            results = ensemble.run_round(inps)
            step += 1
            done = []
            for i, inp, r in zip(order, inps, results):
                steps += 1
                drafted += r.num_draft_tokens
                accepted += len(r.output_ids) - 1
                ids = live[i][1]
                ids += r.output_ids[: max_tokens - (len(ids) - len(prompts[i]))]
                if len(ids) - len(prompts[i]) >= max_tokens:
                    outputs[i] = ids[len(prompts[i]):]
                    done.append((i, inp))
            if done:
                ensemble.release([StepInputs(live[i][0], live[i][1], 0, served, params, step) for i, _ in done])
                for i, _ in done:
                    del live[i]
    sync()
    seconds = time.perf_counter() - start
    return {"outputs": outputs, "seconds": seconds, "steps": steps, "drafted": drafted, "accepted": accepted}


def reference(model, prompts: list[list[int]]) -> list[list[int]]:
    """The target's plain greedy decoding by transformers' ``generate`` (its own DynamicCache), one prompt at a time."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


# A divergence from the reference is a near-tie (numerics, not a bug) when the token emitted instead is the reference's
# second best there and the two best logits lie within this fraction of the largest |logit|: float32 GEMMs over 1 and
# over k+1 positions sum in different orders (~1e-6 relative); bfloat16 rounds each logit to 2^-8 relative.
TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}


def divergence(model, prompt: list[int], ref: list[int], got: list[int], dtype: str) -> dict:
    """Where ``got`` first differs from ``ref``: the gap between the reference's two best logits there (a plain
    forward of prompt + reference prefix), the rank of the token emitted instead, and whether that is a near-tie."""
    i = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ref[:i]], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2)
    gap, scale = float(top.values[0] - top.values[1]), float(logits.abs().max())
    rank = int((logits > logits[got[i]]).sum())
    return {"position": i, "top2_logit_gap": gap, "scale": scale, "emitted_rank": rank,
            "near_tie": rank == 1 and gap <= TIE_TOLERANCE[dtype] * scale}


def make_prompts(n: int, length: int, vocab: int, seed: int = 6) -> list[list[int]]:
    """Token-id prompts with repetition inside each (a phrase said twice, as code repeats names)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        phrase = torch.randint(3, vocab, (length // 4,), generator=g).tolist()
        rest = torch.randint(3, vocab, (length - 2 * len(phrase),), generator=g).tolist()
        prompts.append(phrase + rest[: len(rest) // 2] + phrase + rest[len(rest) // 2:])
    return prompts


def forward_cost(lm) -> dict:
    """Milliseconds of one forward over n = 1..9 new positions on a FORWARD_CACHE-token cache, and the ratio to n=1."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, lm.vocab_size, (FORWARD_CACHE + max(FORWARD_NEW_POSITIONS),), generator=g).tolist()
    seq = 10**9
    lm.logits(seq, ids[:FORWARD_CACHE], 1)
    res = {}
    for n in FORWARD_NEW_POSITIONS:  # the cache keeps the first FORWARD_CACHE tokens; each call recomputes n
        res[n] = timed(partial(lm.logits, seq, ids[:FORWARD_CACHE + n], n), REPS) * 1e3
    lm.release(seq)
    return {"cache_tokens": FORWARD_CACHE, "ms": res, "ratio_to_one": {n: res[n] / res[1] for n in res}}


def decoding(deadline: float) -> dict:
    """Part 3: greedy equality of every method with plain decoding, tokens/s, forward cost."""
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_models_"))
    try:
        built = build_models(folder)
        prompts = make_prompts(PROMPTS, PROMPT_LEN, LLAMA["vocab_size"])
        res = {"target_parameters": built["target_parameters"], "config": LLAMA, "k": K_DECODE,
               "max_tokens": MAX_TOKENS, "prompts": len(prompts), "runs": []}
        methods = ("none", "draft", "ngram", "suffix", "eagle", "self")
        res["verifier_backend"] = VERIFIER_BACKEND
        res["note"] = ("random weights; speeds are overhead checks of the step path (transformers' eager forward is "
                       "bound by kernel launches at these sizes), not what a trained model would reach")
        warm = make_prompts(1, PROMPT_LEN, LLAMA["vocab_size"], seed=99)
        for dtype in ("float32", "bfloat16"):
            if time.perf_counter() > deadline:
                res["runs"].append({"dtype": dtype, "skipped": "time budget"})
                continue
            ens = load_ensembles(built["paths"], dtype, VERIFIER_BACKEND)
            model = ens["none"].target.lm.model
            for method in methods:  # warm-up: CUDA context, cuBLAS, every kernel specialization a method launches
                for batch in (1, 2):
                    decode(ens[method], method, warm * batch, batch, max_tokens=6)
            ref = reference(model, prompts)
            for batch in (1, 8):
                use = prompts if batch > 1 else prompts[: max(2, len(prompts) // 2)]
                for method in methods:
                    if time.perf_counter() > deadline:
                        res["runs"].append({"dtype": dtype, "batch": batch, "method": method,
                                            "skipped": "time budget"})
                        continue
                    r = decode(ens[method], method, use, batch)
                    tokens = MAX_TOKENS * len(use)
                    mismatched = [i for i, (a, b) in enumerate(zip(ref, r["outputs"])) if a != b]
                    run = {"dtype": dtype, "batch": batch, "method": method, "sequences": len(use),
                           "tokens": tokens, "seconds": r["seconds"], "tokens_per_s": tokens / r["seconds"],
                           "mean_tokens_per_step": tokens / r["steps"] if r["steps"] else 0.0,
                           "acceptance_rate": r["accepted"] / r["drafted"] if r["drafted"] else None,
                           "equal_to_plain_greedy": not mismatched, "mismatched_sequences": len(mismatched)}
                    if mismatched:
                        d = [divergence(model, prompts[i], ref[i], r["outputs"][i], dtype) for i in mismatched]
                        run["divergences"] = d
                        run["divergences_at_near_ties"] = all(x["near_tie"] for x in d)
                        if not run["divergences_at_near_ties"]:
                            fail(f"decoding {dtype} batch {batch} {method}: {len(mismatched)} sequences differ "
                                 f"from plain greedy decoding, not at a near-tie ({d[:2]})")
                    res["runs"].append(run)
                    print(f"  {dtype:<9} B={batch} {method:<7}{run['tokens_per_s']:>9.1f} tok/s  "
                          f"tokens/step {run['mean_tokens_per_step']:.2f}  equal {run['equal_to_plain_greedy']}",
                          flush=True)
            if dtype == "bfloat16" and time.perf_counter() < deadline:
                res["forward_cost"] = forward_cost(ens["none"].target.lm)
                print(f"  forward cost (ms by new positions): {res['forward_cost']['ms']}", flush=True)
            del ens, model
            if CUDA:
                torch.cuda.empty_cache()
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------------ main
def versions() -> dict:
    import transformers
    import triton

    v = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
         "transformers": transformers.__version__, "numpy": np.__version__}
    if CUDA:
        v["device_name"] = torch.cuda.get_device_name()
        v["cuda"] = torch.version.cuda
        v["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return v


def equal_note(run: dict) -> str:
    """How a run that differs from plain greedy decoding differs: only at near-ties, or not."""
    return (f"False ({run['mismatched_sequences']} at near-ties)" if run.get("divergences_at_near_ties")
            else f"False ({run['mismatched_sequences']} sequences)")


def table(result: dict) -> str:
    """The short summary printed at the end (and kept in the JSON)."""
    lines = [f"gpu_check on {result['mode']} ({result['versions'].get('device_name', 'CPU, kernels interpreted')}), "
             f"{result['seconds']:.0f} s: {'PASSED' if result['passed'] else 'FAILED'}"
             f"{'' if result['complete'] else ' (incomplete: parts or runs skipped)'}"]
    parts = result["parts"]
    if "kernels" in parts:
        k = parts["kernels"]
        lines.append(f"kernels == torch (same noise)   {k['equal']}/{k['compared']} comparisons")
    if "distribution" in parts:
        worst = min(t["p_value"] for d in parts["distribution"]["tests"].values() for t in d.values())
        lines.append(f"distribution (chi-square)        {parts['distribution']['rows']} rows, lowest p-value "
                     f"{worst:.3g}")
    if "big_batch" in parts:
        b = parts["big_batch"]
        lines.append(f"64-bit offsets                   {b['elements']:,} elements, equal {b['equal']}")
    if "batch_invariance" in parts:
        lines.append(f"seeded batch invariance          {all(parts['batch_invariance']['invariant'].values())}")
    if "bandwidth" in parts:
        bw = parts["bandwidth"]
        lines.append(f"verifier B={bw['B']} k={bw['k']} V={bw['V']} (copy {bw['copy_GB_per_s']:.0f} GB/s):")
        for r in bw["rows"]:
            lines.append(f"  {r['variant']:<34}{r['dtype']:>9}{' greedy' if r['greedy'] else ' sampled':>9}"
                         f"{r['seconds'] * 1e3:>9.3f} ms {r['GB_per_s']:>8.1f} GB/s "
                         f"{100 * r['fraction_of_copy']:>6.1f}% of copy")
    if "decoding" in parts:
        d = parts["decoding"]
        lines.append(f"decoding, {d['target_parameters'] / 1e9:.2f}B random Llama, k={d['k']}, greedy, verifier "
                     f"{d['verifier_backend']} (tokens/s, tokens per step, equal to plain greedy; {d['note']}):")
        for r in d["runs"]:
            if "skipped" in r:
                lines.append(f"  {r['dtype']:<9} {r.get('method', '')} skipped ({r['skipped']})")
                continue
            lines.append(f"  {r['dtype']:<9} B={r['batch']} {r['method']:<7}{r['tokens_per_s']:>9.1f}"
                         f"{r['mean_tokens_per_step']:>6.2f}  {r['equal_to_plain_greedy'] or equal_note(r)}")
        if "forward_cost" in d:
            f = d["forward_cost"]
            lines.append("  forward ms for 1..9 new positions: "
                         + " ".join(f"{f['ms'][n]:.2f}" for n in FORWARD_NEW_POSITIONS))
    if result["failures"]:
        lines.append(f"{len(result['failures'])} failed checks, first: {result['failures'][0]}")
    return "\n".join(lines)


def toolchain() -> dict:
    """What Triton needs to build its kernels' launchers on first use: a C compiler and Python's headers."""
    import sysconfig

    cc = os.environ.get("CC") or next((c for c in ("gcc", "cc", "clang") if shutil.which(c)), None)
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    return {"c_compiler": cc, "python_headers": headers, "ok": bool(cc) and headers}


def main() -> int:
    """Run the parts, save the JSON after each, print the table; 1 when a check failed or a run was skipped."""
    global VERIFIER_BACKEND
    start = time.perf_counter()
    deadline = start + ARGS.budget_s
    result = {"mode": DEV.type, "versions": versions(), "toolchain": toolchain(), "parts": {}}
    print(f"gpu_check: {result['versions']} {result['toolchain']}", flush=True)
    parts = [("kernels", kernels_vs_torch), ("distribution", distribution), ("batch_invariance", batch_invariance),
             ("bandwidth", bandwidth), ("decoding", lambda: decoding(deadline)),
             ("big_batch", big_batch)]  # last: an illegal address there would be a sticky CUDA error for the rest
    if not result["toolchain"]["ok"]:
        fail(f"Triton cannot build its kernels' launchers (needs a C compiler and Python.h): {result['toolchain']}; "
             "the kernel parts are skipped and decoding verifies with the torch backend")
        parts = [("decoding", lambda: decoding(deadline))]
        VERIFIER_BACKEND = "torch"
    ARGS.output.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in parts:
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result["parts"][name] = fn()
        except Exception as exc:  # noqa: BLE001 - one part's crash is reported and the rest still run
            fail(f"{name} crashed: {type(exc).__name__}: {exc}")
            result.setdefault("tracebacks", {})[name] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
        result.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t, 1)
        result["seconds"] = time.perf_counter() - start
        result["failures"] = FAILURES
        ARGS.output.write_text(json.dumps(result, indent=2, default=str))  # kept if a later part hangs
    skipped = [r for r in result["parts"].get("decoding", {}).get("runs", []) if "skipped" in r]
    result["complete"] = len(result["parts"]) == 6 and not skipped
    result["passed"] = not FAILURES and result["complete"]
    result["table"] = table(result)
    ARGS.output.write_text(json.dumps(result, indent=2, default=str))
    print(result["table"])
    print(f"saved {ARGS.output}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
