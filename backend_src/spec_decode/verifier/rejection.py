"""Public verifier API: rejection sampling and typical acceptance, on Triton kernels (CUDA) or torch (CPU).

Vocabulary (as vLLM v1's ``rejection_sampler.py``), per row of a batch:

- accepted tokens: the leading drafts the test accepts, a prefix of the row's k drafts;
- recovered token: drawn at the first rejected draft, from the residual normalize(max(0, p_i - q_i));
- bonus token: drawn from the target alone at the position after the last accepted draft when no draft was rejected
  there (all k accepted, or a -1 placeholder reached);
- placeholder: a draft id of -1, padding a row to the batch's k (:class:`~spec_decode.verifier.Verifier`).

Rejection sampling follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"), Chen et
al. 2023 and vLLM's ``RejectionSampler``: draft x_i is accepted with probability min(1, p(x_i) / q(x_i)); at the first
rejection a recovered token is drawn from normalize(max(0, p_i - q_i)); when all k drafts are accepted a bonus token is
drawn from target_probs[k]. The output distribution equals the target's exactly. The rule at each boundary (p = 0,
q = 0, p = q, u at 0 or near 1, empty residuals, placeholders, half-precision underflow, invalid values) is listed in
:func:`rejection_sample`. Typical acceptance follows Medusa (Cai et al. 2024) and vLLM's ``TypicalAcceptanceSampler``;
it is faster and NOT lossless. docs/verifier.md shows the API in use.

The coupled sampler (:func:`coupled_sample`) is the drafter-invariant alternative for seeded requests (Daliri et al.
2024, "Drafter-invariant speculative decoding"; the Gumbel-max / exponential-race coupling): the target's token at each
position is a race keyed by (seed, absolute position) only, and a draft is accepted iff it equals that token, so the
output does not depend on the drafts, k or the step structure.
"""

from __future__ import annotations

import math
import os

import torch

from ..sampling import NoisePurpose, coupled_seed, generator_for
from ..settings import InvalidInputError, one_of
from .torch_impl import _first_rejection, rejection_torch, typical_torch

VERIFIER_BACKENDS = ("auto", "triton", "torch")  # rejection_sample's backend: see its docstring
TYPICAL_EPSILON, TYPICAL_ALPHA = 0.09, 0.3  # typical acceptance's defaults (Medusa, vLLM)
FLOAT32_MAX = 3.4028234663852886e38
MAX_K = 65535  # the most drafts per row: the kernels draw the race's noise from Philox offsets 2^16 and up


def check_typical_parameters(posterior_threshold: float, posterior_alpha: float,
                             names: tuple[str, str] = ("posterior_threshold", "posterior_alpha")) -> None:
    """Check typical acceptance's epsilon and delta: finite numbers in [0, 3.4e38] (they are used as float32 values).

    Args:
        posterior_threshold, posterior_alpha: the values to check.
        names: how the error names them.

    Raises:
        InvalidInputError: naming the parameter and the allowed range (negative, NaN, infinite, beyond float32, or
            not a number).
    """
    for name, x in zip(names, (posterior_threshold, posterior_alpha)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not 0 <= x <= FLOAT32_MAX:
            raise InvalidInputError(name, f"allowed values are finite numbers in [0, {FLOAT32_MAX:.3g}], got {x!r}")


def validate_inputs(
    target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None
) -> None:
    """Check types, shapes, dtypes, devices and the token-id range.

    Probability values (NaN, infinite, negative) are checked by the samplers themselves: the torch path over whole
    tensors, the kernels in the passes they make (:mod:`spec_decode.verifier.checks`).

    Raises:
        ValueError: naming the offending argument and what is allowed.
    """
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(
            f"target_probs must be a [B, k+1, V] tensor, got shape {tuple(getattr(target_probs, 'shape', ()))}"
        )
    if target_probs.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"target_probs dtype must be float32, float16 or bfloat16, got {target_probs.dtype}")
    b, k1, v = target_probs.shape
    if k1 < 1 or v < 1:
        raise ValueError(
            f"target_probs must have k+1 >= 1 positions and V >= 1 tokens, got {tuple(target_probs.shape)}"
        )
    if k1 - 1 > MAX_K:
        raise ValueError(f"target_probs has k = {k1 - 1} draft positions; allowed: at most {MAX_K}")
    if not isinstance(draft_token_ids, torch.Tensor):
        raise ValueError(f"draft_token_ids must be a [B, k] int64 tensor, got {type(draft_token_ids).__name__}")
    if draft_token_ids.dim() != 2 or tuple(draft_token_ids.shape) != (b, k1 - 1):
        raise ValueError(f"draft_token_ids must be [B, k] = [{b}, {k1 - 1}], got shape {tuple(draft_token_ids.shape)}")
    if draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids dtype must be int64, got {draft_token_ids.dtype}")
    if draft_token_ids.device != target_probs.device:
        raise ValueError(f"draft_token_ids is on {draft_token_ids.device}, target_probs on {target_probs.device}")
    if draft_token_ids.numel() and (int(draft_token_ids.max()) >= v or int(draft_token_ids.min()) < -1):
        raise ValueError(f"draft_token_ids must lie in [0, {v}) (or be -1 for a placeholder)")
    if draft_probs is not None:
        if not isinstance(draft_probs, torch.Tensor):
            raise ValueError(f"draft_probs must be a [B, k, V] tensor or None, got {type(draft_probs).__name__}")
        if tuple(draft_probs.shape) != (b, k1 - 1, v):
            raise ValueError(f"draft_probs must be [B, k, V] = [{b}, {k1 - 1}, {v}], got {tuple(draft_probs.shape)}")
        if draft_probs.dtype != target_probs.dtype:
            raise ValueError(f"draft_probs dtype {draft_probs.dtype} differs from target_probs {target_probs.dtype}")
        if draft_probs.device != target_probs.device:
            raise ValueError(f"draft_probs is on {draft_probs.device}, target_probs on {target_probs.device}")


def _resolve_backend(backend: str, device: torch.device) -> str:
    backend = one_of("backend", backend, VERIFIER_BACKENDS)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
    return backend


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _row_flags(b: int, seeds, is_greedy, device) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds [B] int64 (unseeded rows get a fresh random seed) and is_greedy [B] bool, on ``device``."""
    if seeds is None:
        seeds = torch.full((b,), -1, dtype=torch.int64)
    if not isinstance(seeds, torch.Tensor) or seeds.shape != (b,) or seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be an int64 tensor of shape [{b}], got {_describe(seeds)}")
    seeds = seeds.to(device)
    unseeded = seeds < 0
    if bool(unseeded.any()):
        seeds = torch.where(unseeded, torch.randint(0, 2**62, (b,), device=device), seeds)
    if is_greedy is None:
        is_greedy = torch.zeros(b, dtype=torch.bool)
    if not isinstance(is_greedy, torch.Tensor) or is_greedy.shape != (b,):
        raise ValueError(f"is_greedy must be a bool tensor of shape [{b}], got {_describe(is_greedy)}")
    return seeds, is_greedy.to(device=device, dtype=torch.bool)


def _torch_noise(seeds: torch.Tensor, greedy: torch.Tensor, draft_token_ids: torch.Tensor,
                 v: int, lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row noise from a generator keyed by (row seed, purpose): uniform [B, k], exponential [B, V] (CPU).

    A row draws uniforms for its drafts before its first -1 placeholder only (``lengths``: per row, how many it draws
    instead; the rest stay 0: never used), so a row padded to a batch's longer k draws what it draws alone. Greedy rows
    use no noise (they get zeros and ones, which their argmax walk ignores)."""
    b, k = draft_token_ids.shape
    u = torch.zeros(b, k)
    e = torch.ones(b, v)
    if lengths is None:
        lengths = _first_rejection((draft_token_ids >= 0).cpu()).tolist()  # drafts before the first placeholder
    for row, (s, g) in enumerate(zip(seeds.tolist(), greedy.tolist())):
        if not g:
            u[row, : lengths[row]] = torch.rand(lengths[row], generator=generator_for(s, NoisePurpose.VERIFIER_UNIFORM))
            e[row].exponential_(1.0, generator=generator_for(s, NoisePurpose.VERIFIER_RACE)).clamp_min_(1e-30)
    return u, e


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seeds: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Verify draft tokens against the target distribution by rejection sampling (lossless).

    Draft x_i is accepted with probability min(1, p/q) (p = target_probs[b, i, x_i], q = draft_probs[b, i, x_i]);
    at the first rejection a recovered token is drawn from normalize(max(0, p_i - q_i)); when all k are accepted a
    bonus token is drawn from target_probs[b, k]. Boundary rules (both backends, bit for bit when fed the same noise;
    u ~ U[0, 1) is the accept uniform):

    - Accept test: ``q > 0 and (p >= q or u * q < p)``, in float32, without a division.
      p = 0: never accepted. u = 0: accepted iff p > 0. p = q (equal stored values): accepted for every u, including
      u = 1 - 2^-24. p > q: always accepted. Without draft probabilities q is one-hot at the draft: ``u < p``.
    - q = 0 (a draft its own distribution could not have proposed, e.g. outside the draft's top-k/top-p, or a
      probability that underflowed): rejected, whatever p (as vLLM). The recovered distribution max(0, p - q) keeps
      p(x) at x, so x can still be the recovered token when p(x) > 0; with p = q = 0 it never is.
    - A -1 placeholder is rejected without indexing and ends the row's drafts: its position gets a bonus token, drawn
      from p at that position (not from a residual).
    - Recovered and bonus tokens are drawn by the exponential race argmax(d / E); entries with d = 0 score -1, so a
      token of zero residual (or zero p for a bonus token) never wins, even if every d / E underflows. Hence no token
      with p = 0 is ever emitted.
    - An all-zero residual (p <= q everywhere: the rejection had probability 0 in exact arithmetic, e.g. p equals q up
      to rounding and u is near 1) falls back to a draw from p: never NaN, never a zero-probability token.
    - One-hot rows: where the target is one-hot at t, the row's token at that position is t whatever the draft and
      the noise (a drafted t is accepted when q(t) > 0, otherwise rejected and recovered as t; any other draft has
      p = 0 and is rejected, and t is the only token with residual or p above 0).
    - Greedy rows: accept while x_i == argmax(p_i) (lowest index on ties) and p(x_i) > 0; emit the argmax.
    - Half precision is compared in float32 after exact conversion: a value that underflowed to 0 when it was stored
      (below half the smallest subnormal: about 4.6e-41 in bfloat16, 3e-8 in float16) is 0 and follows the p = 0 /
      q = 0 rules; subnormals stay positive.
    - NaN, +inf, -inf or negative probabilities raise ValueError: on the torch path anywhere in either tensor; in the
      kernels wherever a program reads them (flagged in the same pass over V). A target row the verifier has to
      sample from that sums to zero raises ValueError on both paths.

    Args:
        target_probs: [B, k+1, V] float32 (bfloat16/float16 accepted); each row a distribution (unnormalised rows
            are fine for the race; the accept test reads p as a probability); row k is the bonus position.
        draft_token_ids: [B, k] int64; -1 is a placeholder (see above).
        draft_probs: [B, k, V] like ``target_probs``, or None for drafts without probabilities (n-gram, suffix): q is
            one-hot at the draft token, so x_i is accepted with probability p(x_i) and the recovered distribution is p
            with p(x_i) set to zero.
        seeds: None or int64 [B]; a row with seed >= 0 draws its noise from (seed, position) only, so it is
            reproducible and independent of the rest of the batch and of -1 padding after its drafts (a batch of rows
            with different k); -1 = unseeded (fresh randomness).
        is_greedy: None or bool [B]; greedy rows accept while the draft equals argmax(target_probs[i]) and then emit
            the argmax (token for token the target's own greedy decoding).
        backend: "auto" (Triton kernels for CUDA tensors, torch for CPU), "triton" (on CPU only under
            TRITON_INTERPRET=1) or "torch".

    Returns:
        [B, k+1] int64 on the input device: accepted drafts, then the recovered or bonus token, then -1 padding.

    Raises:
        ValueError: bad shapes, dtypes or devices, ids outside [0, V), unknown backend; NaN, infinite or negative
            probabilities; a sampled target row that sums to zero (messages from :mod:`spec_decode.verifier.checks`,
            the same on both paths).
    """
    validate_inputs(target_probs, draft_token_ids, draft_probs)  # first: a non-tensor has no .device to read
    b, k1, v = target_probs.shape
    which = _resolve_backend(backend, target_probs.device)
    seeds, greedy = _row_flags(b, seeds, is_greedy, target_probs.device)
    if which == "triton":
        from .kernels import rejection_triton

        return rejection_triton(target_probs, draft_token_ids, draft_probs, seeds, greedy)
    u, e = _torch_noise(seeds, greedy, draft_token_ids, v)
    dev = target_probs.device
    return rejection_torch(target_probs, draft_token_ids, draft_probs, u.to(dev), e.to(dev), greedy)


def typical_acceptance_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    *,
    posterior_threshold: float = TYPICAL_EPSILON,
    posterior_alpha: float = TYPICAL_ALPHA,
    seeds: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Typical acceptance (Medusa; vLLM ``TypicalAcceptanceSampler``): fast, deterministic acceptance, NOT lossless.

    Draft x_i is accepted when p(x_i) > min(posterior_threshold, posterior_alpha * exp(-H(p_i))), H the entropy of
    target_probs[i]. At the first rejected draft the argmax of target_probs[i] is emitted; if all k pass, the bonus
    token is drawn from target_probs[k] (seeded like :func:`rejection_sample`; argmax for greedy rows). Boundary
    rules (both backends):

    - The test is strict, so p(x) = 0 is never accepted; with epsilon = 0 or alpha = 0 every x with p(x) > 0 is.
      H uses 0 log 0 = 0: a one-hot target has H = 0 and threshold min(epsilon, alpha).
    - epsilon and alpha are used as float32 values. H and the threshold are computed in float32, and again in float64
      for a p(x) within 2^-10 of the threshold; there a p(x) above the threshold by less than 2^-28 of it (below
      float32's resolution: only exact ties, such as a uniform target with alpha = 1) counts as equal and is
      rejected, so both paths decide ties alike despite their different summation orders.
    - A -1 placeholder is rejected and ends the row's drafts: its position gets a bonus token (drawn from p).
    - The bonus draw never picks a zero-probability token (its race score is -1); the argmax picks the lowest index
      on ties.
    - Greedy rows: accept while x_i == argmax(p_i) and p(x_i) > 0 (the argmax walk of :func:`rejection_sample`).
    - NaN, infinite or negative probabilities, and a sampled row that sums to zero, raise ValueError as in
      :func:`rejection_sample` (the kernel reads, and so checks, each position's row up to the first rejected draft,
      and the sampled one).

    Args:
        target_probs: [B, k+1, V] float32 (bfloat16/float16 accepted).
        draft_token_ids: [B, k] int64 (-1 placeholders end the drafts).
        posterior_threshold: epsilon >= 0. posterior_alpha: delta >= 0.
        seeds, is_greedy, backend: as in :func:`rejection_sample`.

    Returns:
        [B, k+1] int64: accepted drafts, the replacement or bonus token, -1 padding.

    Raises:
        ValueError: as :func:`rejection_sample`, and epsilon or alpha negative, NaN, infinite or beyond float32
            (:func:`check_typical_parameters`).
    """
    check_typical_parameters(posterior_threshold, posterior_alpha)
    validate_inputs(target_probs, draft_token_ids, None)  # first: a non-tensor has no .device to read
    b, k1, v = target_probs.shape
    which = _resolve_backend(backend, target_probs.device)
    seeds, greedy = _row_flags(b, seeds, is_greedy, target_probs.device)
    if which == "triton":
        from .kernels import typical_triton

        return typical_triton(target_probs, draft_token_ids, posterior_threshold, posterior_alpha, seeds, greedy)
    _, e = _torch_noise(seeds, greedy, draft_token_ids[:, :0], v)
    return typical_torch(target_probs, draft_token_ids, posterior_threshold, posterior_alpha,
                         e.to(target_probs.device), greedy)


def coupled_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    *,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Verify drafts by the coupled race (Daliri et al. 2024, "Drafter-invariant speculative decoding"): lossless, and
    a row's output is a function of its target distributions, seed and position only, never of its drafts or k.

    Row b's target token at draft position i is t_i = argmax(p_i / E) with E ~ Exp(1) keyed by (seeds[b],
    positions[b] + i) alone (:func:`spec_decode.sampling.coupled_seed`): a row of :func:`rejection_sample` with k = 0
    (its bonus race) and that seed, on the chosen backend (torch: a CPU generator; Triton: Philox in-kernel, so the two
    backends give different, equally distributed, tokens). Draft i is accepted iff draft_i == t_i and every draft
    before it was; at the first mismatch (or -1 placeholder) t_i is emitted; when all k match, t_k is the bonus token.
    Since each t_i is an exact draw from p_i with noise independent of the other positions, the emitted tokens follow
    the target's law whatever the drafts (drafts without probabilities are accepted with probability p(x), as by
    rejection sampling; drafts raced with the same noise, :func:`spec_decode.sampling.coupled_exponentials`, whenever
    both races agree). Every position a row may reach (up to its first -1 placeholder, and the bonus) is raced in one
    sampler call (one kernel launch on CUDA), each (row, position) with its own seed, so the host reads the tokens
    once; the positions past a row's first mismatch are raced and dropped (the same tokens as racing only the rows
    that matched: each row's race depends on its own seed alone). Boundary rules are those of the race in
    :func:`rejection_sample`: a zero-probability token never wins, ties go to the lowest index.

    Args:
        target_probs: [B, k+1, V] float32 (bfloat16/float16 accepted): the target's distributions after the sampling
            transforms.
        draft_token_ids: [B, k] int64 in [0, V), or -1 placeholders (rejected: the row's drafts end there).
        seeds: int64 [B] >= 0, the requests' seeds.
        positions: int64 [B] >= 0, the absolute position of each row's first draft (the number of its committed
            token ids).
        backend: as :func:`rejection_sample`.

    Returns:
        [B, k+1] int64 on the input device: accepted drafts, the target's token at the first mismatch, -1 padding.

    Raises:
        ValueError: as :func:`rejection_sample` (shapes, dtypes, devices, ids, invalid probabilities or a zero row at a
            position raced), and seeds or positions that are not int64 [B] >= 0.
    """
    validate_inputs(target_probs, draft_token_ids, None)
    b, k1, v = target_probs.shape
    for name, x in (("seeds", seeds), ("positions", positions)):
        if not isinstance(x, torch.Tensor) or x.shape != (b,) or x.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 tensor of shape [{b}], got {_describe(x)}")
        if b and int(x.min()) < 0:
            raise ValueError(f"{name} must be >= 0")
    dev = target_probs.device
    drafts = draft_token_ids.cpu().tolist()
    seed_list, pos_list = seeds.tolist(), positions.tolist()
    # every position a row may reach (up to its first -1 placeholder, and the bonus) raced in one call, one row per
    # (row, position), each with its own seed: the host reads the drafts once and the tokens once, not per position
    spans = [next((i for i, d in enumerate(row) if d < 0), k1 - 1) + 1 for row in drafts]
    pairs = [(r, i) for r in range(b) for i in range(spans[r])]
    out_rows = [[-1] * k1 for _ in range(b)]
    if pairs:
        pick = torch.tensor(pairs, device=dev)
        row_seeds = torch.tensor([coupled_seed(seed_list[r], pos_list[r] + i) for r, i in pairs], dtype=torch.int64)
        tp = target_probs[pick[:, 0], pick[:, 1]][:, None]  # [M, 1, V]: each a k = 0 row, raced with its own seed
        tokens = rejection_sample(tp, torch.empty((len(pairs), 0), dtype=torch.int64, device=dev), None,
                                  seeds=row_seeds, backend=backend)[:, 0].cpu().tolist()
        race = dict(zip(pairs, tokens))
        for r in range(b):
            for i in range(spans[r]):
                out_rows[r][i] = race[(r, i)]
                if i == spans[r] - 1 or drafts[r][i] != race[(r, i)]:
                    break
    return torch.tensor(out_rows, dtype=torch.int64, device=dev).reshape(b, k1)
