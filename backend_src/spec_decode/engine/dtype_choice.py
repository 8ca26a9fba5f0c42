"""What ``dtype: auto`` serves, and why: bfloat16 on a GPU and on a CPU that multiplies bfloat16 natively with
batch-invariant kernels, float32 elsewhere.

On a CPU, bfloat16 pays only where the CPU has bfloat16 dot-product instructions (``amx_bf16``: Intel AMX;
``avx512_bf16``: AVX-512 BF16), the flags of ``/proc/cpuinfo``; elsewhere PyTorch converts to float32 and back around
every product, and bfloat16 runs slower than float32. Measured on a 2-core Xeon with AVX-512 BF16 and no AMX
(docs/benchmarks.md, "bfloat16 on the CPU"): one position of the embedded SmolLM2-135M costs ~0.7x float32's, and 17
positions ~1.3x one (float32: ~1.8x), so AVX-512 BF16 alone qualifies. vLLM's CPU backend likewise serves bfloat16 by
default where the CPU has it.

Exactness comes first: speculative greedy decoding must give plain decoding's tokens, which needs a forward whose rows
do not depend on the round's other rows (:mod:`.invariant_attention`). :func:`kernels_batch_invariant` checks the
CPU's kernels for that on random data before ``auto`` picks bfloat16 (a few hundred milliseconds, once per process);
where they fail, ``auto`` serves float32 and says so. :func:`probe_forward` checks a loaded model's whole forward.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bfloat16 products, best first
NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model is served in and the reason, as the load log and the launcher's banner print it."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16`` or ``float16``."""
        return str(self.dtype).removeprefix("torch.")

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def cpu_bf16_flag(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first of :data:`CPU_BF16_FLAGS` the CPU reports (``/proc/cpuinfo``'s flags), or None (none of them, or no
    such file: not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return next((f for f in CPU_BF16_FLAGS if f in flags), None)


@functools.cache
def kernels_batch_invariant(dtype: torch.dtype = torch.bfloat16, trials: int = 4) -> bool:
    """Whether this machine's CPU kernels give every row the same result whatever the other rows, as the engine calls
    them (products of at least :data:`~.invariant_attention.MIN_ROWS_LINEAR` rows; the attention of
    :func:`~.invariant_attention.invariant_attention`): linear layers of the shapes of a small decoder (576 -> 1,536,
    1,536 -> 576, 576 -> 576) over 2-40 rows against the same rows among 64, and the attention over 1 and 5-17
    query rows on 300-600 keys against one row at a time. Seeded random data (a private generator), ``trials``
    repeats at several scales; cached per dtype for the process."""
    from .invariant_attention import MIN_ROWS_LINEAR, invariant_attention

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    for t in range(trials):
        scale = 10.0 ** (t % 3 - 1)
        for k, n in ((576, 1536), (1536, 576), (576, 576)):
            w, x = rand(n, k, scale=0.05), rand(64, k, scale=scale)
            full = F.linear(x, w)
            for m in (MIN_ROWS_LINEAR, 3, 5, 17, 40):
                if not torch.equal(F.linear(x[:m], w), full[:m]):
                    return False
        ctx = 300 + 100 * t
        q, k_, v = rand(1, 9, 17, 64, scale=scale), rand(1, 3, ctx + 17, 64), rand(1, 3, ctx + 17, 64)
        pos = torch.arange(ctx, ctx + 17)
        mask = torch.where(torch.arange(ctx + 17)[None] <= pos[:, None], 0.0, torch.finfo(dtype).min).to(dtype)
        for rows in (5, 17):
            full, _ = invariant_attention(None, q[:, :, :rows], k_[:, :, : ctx + rows], v[:, :, : ctx + rows],
                                          mask[None, None, :rows, : ctx + rows])
            for j in (0, rows - 1):
                one, _ = invariant_attention(None, q[:, :, j : j + 1], k_[:, :, : ctx + j + 1],
                                             v[:, :, : ctx + j + 1], mask[None, None, j : j + 1, : ctx + j + 1])
                if not torch.equal(one[:, 0], full[:, j]):
                    return False
    return True


def choose_dtype(dtype: str, device: torch.device, cpu_flag: str | None = None) -> DtypeChoice:
    """The dtype a model is served in on ``device`` for the config value ``dtype``, with the reason.

    ``auto``: bfloat16 on CUDA; on a CPU bfloat16 where it has one of :data:`CPU_BF16_FLAGS` and its kernels pass
    :func:`kernels_batch_invariant`, else float32. Any other name is served as given (bfloat16 asked for on a CPU whose
    kernels are not batch-invariant is served, with a warning that speculative greedy output may then differ from
    plain decoding's).

    Args:
        dtype: ``auto``, ``float32``, ``float16`` or ``bfloat16`` (:class:`~spec_decode.settings.LMSettings`).
        device: where the model runs.
        cpu_flag: the CPU's bfloat16 flag (default: :func:`cpu_bf16_flag`; tests pass their own).

    Raises:
        KeyError: another name.
    """
    if dtype != "auto":
        chosen = NAMES[dtype]
        if device.type == "cpu" and chosen != torch.float32 and not kernels_batch_invariant(chosen):
            logger.warning("dtype %s on this CPU: its kernels are not batch-invariant, so speculative greedy output "
                           "may differ from plain decoding's on a few positions; dtype auto would serve float32", dtype)
        return DtypeChoice(chosen, "asked for")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto: a GPU")
    flag = cpu_bf16_flag() if cpu_flag is None else cpu_flag
    if not flag:
        flags = " or ".join(CPU_BF16_FLAGS)
        return DtypeChoice(torch.float32, f"auto: this CPU has no native bfloat16 products ({flags})")
    if not kernels_batch_invariant(torch.bfloat16):
        return DtypeChoice(torch.float32, f"auto: this CPU has {flag}, but its bfloat16 kernels are not "
                                          f"batch-invariant here, so speculation could change greedy output")
    return DtypeChoice(torch.bfloat16, f"auto: this CPU multiplies bfloat16 natively ({flag}) and its kernels "
                                       f"passed the batch-invariance check")


def probe_forward(lm, positions: int = 5, context: int = 48, seq_id: int = 2**63 - 7) -> int:
    """Positions among ``positions`` whose logits differ between one forward over all of them and one forward per
    position (0: the loaded model's forward is batch-invariant here). Runs on seeded random tokens in a sequence of
    its own, released after.

    Args:
        lm: a :class:`~.kv_cache.CachedCausalLM`.
    """
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, lm.vocab_size, (context + positions,), generator=gen).tolist()
    try:
        lm.logits(seq_id, ids[:context], 1)
        together = lm.logits(seq_id, ids, positions)
        apart = []
        for j in range(positions):
            apart.append(lm.logits(seq_id, ids[: context + j + 1], 1)[0])
    finally:
        lm.release(seq_id)
    return sum(int(not torch.equal(together[j], apart[j])) for j in range(positions))


__all__ = ["CPU_BF16_FLAGS", "DtypeChoice", "choose_dtype", "cpu_bf16_flag", "kernels_batch_invariant",
           "probe_forward"]
