"""Sampling parameters, transforms and noise shared by the draft and the target.

The same transforms (temperature, top-k, top-p) are applied to draft and target logits, so that rejection sampling
compares the two distributions the request actually samples from (as vLLM's spec-decode worker does).
Randomness is a pure function of (request seed, step, purpose, position): see :func:`generator_for`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from .settings import InvalidInputError, in_range

_MASK64 = (1 << 64) - 1
MAX_TEMPERATURE = 100


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters.

    The one place of the sampling rules: generate's requests and the step models' inputs are checked here.

    Attributes:
        temperature: in [0, 100]; 0 means greedy (argmax) decoding.
        top_k: keep the k most probable tokens, >= 0; 0 disables.
        top_p: keep the smallest set of tokens whose probability mass reaches top_p, in (0, 1]; 1 disables.
        seed: request seed, a non-negative 63-bit integer (``generate`` draws one when the client sends none).
        seeded: True when ``seed`` came from the client. A seeded request must be reproducible whatever else runs, so
            its drafts may depend only on the request itself (suffix decoding then skips the global response tree).

    Raises:
        InvalidInputError: (construction) a value out of range, naming it (``temperature``, ``top_k``, ``top_p``).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    seeded: bool = True

    def __post_init__(self):
        in_range("temperature", self.temperature, 0, MAX_TEMPERATURE, " (0 = greedy)")
        in_range("top_k", self.top_k, 0, None, " (0 = disabled)")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise InvalidInputError("top_p", f"must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        """True when temperature is 0 (argmax decoding)."""
        return self.temperature <= 0.0


class NoisePurpose(IntEnum):
    """What a draw of noise is for, mixed into its seed so that no two uses of one request's seed share noise.

    The values are part of a seeded request's output: changing one changes the tokens it samples.
    """

    VERIFIER_UNIFORM = 1  # the rejection sampler's accept tests u_i ~ U[0, 1) (torch path)
    VERIFIER_RACE = 2  # the rejection sampler's exponential race for the recovered or bonus token (torch path)
    DRAFT_LM = 3  # the draft LM's sampled drafts
    # 4 is retired: left unused, since renumbering a purpose would change its seeded outputs
    EAGLE = 5  # the EAGLE head's sampled drafts
    COUPLED = 6  # the coupled race of a seeded request: its token at an absolute position (verifier and drafts)
    MEDUSA = 7  # Medusa's heads' sampled drafts
    MLP_SPECULATOR = 8  # the MLP speculator's sampled drafts
    ARCTIC = 9  # Arctic Inference's MLP and LSTM speculators' sampled drafts
    EAGLE3 = 10  # the EAGLE-3 head's sampled drafts


def mix_seed(*parts: int) -> int:
    """Hash integers into one 63-bit seed (splitmix64 steps); a pure function of its arguments."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


def generator_for(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`mix_seed` of ``parts`` (e.g. seed, step, purpose, position)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(mix_seed(*parts))
    return g


def coupled_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's coupled race at absolute token position ``position`` (the index the token will
    have in the sequence's token ids): ``mix_seed(seed, NoisePurpose.COUPLED, position)``, a pure function of the two
    (no step counter, no k, no drafts), 63 bits. The verifier samples the target's token there with it
    (:func:`spec_decode.verifier.rejection.coupled_sample`) and the model proposers draw their draft for that position
    with the same noise (:func:`coupled_exponentials`); Daliri et al. 2024, "Drafter-invariant speculative decoding".
    """
    return mix_seed(seed, NoisePurpose.COUPLED, position)


def coupled_exponentials(seed: int, position: int, size: int) -> torch.Tensor:
    """The exponential noise E [size] float32 (CPU, each >= 1e-30) of a seeded request's coupled race at ``position``.

    Exactly the noise the verifier's torch path races the target's distribution with at that position: a row of
    :func:`spec_decode.verifier.rejection.rejection_sample` with k = 0 and seed :func:`coupled_seed` (its race draws
    ``exponential_`` from ``generator_for(row seed, NoisePurpose.VERIFIER_RACE)``). A proposer that races its own
    distribution with the noise of the target's vocabulary (``size`` = the target's V, gathered at the proposer's
    columns) drafts the target's token whenever both races agree. The Triton kernels draw their own (Philox) noise, so
    there the drafts are exact samples of q but not coupled to the target's token.
    """
    e = torch.empty(size, dtype=torch.float32)
    return e.exponential_(1.0, generator=generator_for(coupled_seed(seed, position), NoisePurpose.VERIFIER_RACE)
                          ).clamp_min_(1e-30)


def race(probs: torch.Tensor, exponential: torch.Tensor, lazy: bool = False) -> int | torch.Tensor:
    """The exponential race argmax(probs / E) over [N] (a draw from normalize(probs) when E ~ Exp(1) i.i.d.; gpt-fast,
    vLLM). Entries with probs == 0 rank below every other entry (score -1), so a zero-probability token never wins;
    ties go to the lowest index. ``probs`` any float dtype and device; ``exponential`` [N] float32 (on the CPU, where
    it is drawn: it is copied to ``probs``' device, and the race runs there, in float32 as on the CPU). Returns the
    index as an int, or with ``lazy`` as a 0-dim int64 tensor on that device, not read by the host."""
    p = probs.float()
    e = exponential.to(p.device)
    best = torch.argmax(torch.where(p > 0, p / e, torch.full_like(p, -1.0)))
    return best if lazy else int(best)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits and return probabilities.

    Args:
        logits: [..., V] any float dtype, any device.
        params: sampling parameters; with temperature 0 the plain softmax is returned (the verifier takes its argmax).

    Returns:
        [..., V] float32 probabilities on the same device; each row sums to 1.

    Follows gpt-fast's ``logits_to_probs`` and the HF/vLLM top-k/top-p warpers.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.softmax(logits, dim=-1)
    # Shift by the row maximum before dividing (softmax is shift-invariant): a tiny temperature then sends the other
    # logits to -inf instead of overflowing to inf - inf = NaN; the limit is the argmax, as it should be.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the most probable token always stays).
        drop_sorted = (cum - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [V] distribution by the exponential race argmax(p / E), E ~ Exp(1) (gpt-fast).

    ``probs`` may be unnormalised, any float dtype, any device. The noise is drawn on the CPU from ``generator`` (None:
    torch's global generator) so that a seeded draw does not depend on the device.
    """
    e = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(1.0, generator=generator)
    return int(torch.argmax(probs.float().cpu() / e).item())
