"""What every part of the GPU check shares: the sizes of a run (full on CUDA, tiny on CPU) and the failure record.

Imported only once ``TRITON_INTERPRET`` is settled (:func:`bench.gpu_check.__main__.main`): it imports torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

K_DECODE = 4  # drafts per step in the decoding part
FORWARD_NEW_POSITIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # the forward cost part's new positions per forward
FORWARD_CACHE = 300  # tokens already cached before each of those forwards


@dataclass(frozen=True)
class Sizes:
    """The sizes of one run.

    Attributes:
        vocabs, ks, batches, dtypes: the grid of the kernels-against-torch part (V, k, B, probability dtype).
        dist_rows, dist_v, dist_k: the distribution test's rows, vocabulary and k.
        big_v, big_k, big_b: the big batch (B x (k+1) x V above 2^31 elements on CUDA).
        invariance: (B, k, V) of the batch-invariance check.
        bandwidth: (B, k, V) of the bandwidth part.
        llama: the random target's ``LlamaConfig`` keyword arguments.
        prompts, prompt_len, max_tokens: the decoding part's prompts, their length and new tokens each (tokens).
        reps: timed repeats of a measurement (median).
    """

    vocabs: tuple[int, ...]
    ks: tuple[int, ...]
    batches: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    dist_rows: int
    dist_v: int
    dist_k: int
    big_v: int
    big_k: int
    big_b: int
    invariance: tuple[int, int, int]
    bandwidth: tuple[int, int, int]
    llama: dict[str, int]
    prompts: int
    prompt_len: int
    max_tokens: int
    reps: int


_BIG_V, _BIG_K = 151936, 8

FULL = Sizes(
    vocabs=(49152, 128256, 151936), ks=(1, 4, 8), batches=(1, 8, 64), dtypes=(torch.float32, torch.bfloat16),
    dist_rows=1 << 20, dist_v=16, dist_k=3,
    big_v=_BIG_V, big_k=_BIG_K, big_b=2**31 // (_BIG_K * _BIG_V) + 2,  # B x k x V (draft) and B x (k+1) x V > 2^31
    invariance=(64, 4, 128256), bandwidth=(64, 5, 128256),
    llama=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    prompts=8, prompt_len=64, max_tokens=48, reps=20,
)
"""CUDA: the sizes the check exists for."""

TINY = Sizes(
    vocabs=(37, 5000), ks=(1, 3), batches=(1, 3), dtypes=(torch.float32, torch.bfloat16),
    dist_rows=240, dist_v=4, dist_k=2,
    big_v=5000, big_k=2, big_b=3,
    invariance=(5, 3, 300), bandwidth=(4, 3, 5000),
    llama=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512),
    prompts=3, prompt_len=24, max_tokens=12, reps=3,
)
"""CPU: tiny, since the interpreter runs a Triton program in numpy, one at a time."""


@dataclass
class Context:
    """The device and sizes of a run, the verifier backend the decoding part serves, and the failed checks.

    Attributes:
        device: where every tensor of the check lives.
        sizes: :data:`FULL` on CUDA, :data:`TINY` on CPU.
        verifier_backend: the served verifier's ``backend`` (``auto``: the Triton kernels on CUDA; ``torch`` when
            Triton cannot build its launchers, see :func:`bench.gpu_check.report.toolchain`).
        failures: one message per failed check, in order.
    """

    device: torch.device
    sizes: Sizes
    verifier_backend: str = "auto"
    failures: list[str] = field(default_factory=list)

    @classmethod
    def for_device(cls, device: str) -> Context:
        """The context of a run on ``device`` (``cuda`` or ``cpu``), with that device's sizes."""
        return cls(torch.device(device), FULL if device == "cuda" else TINY)

    @property
    def cuda(self) -> bool:
        """Whether the run is on CUDA (else CPU mode: tiny sizes, kernels interpreted)."""
        return self.device.type == "cuda"

    def fail(self, msg: str) -> None:
        """Record a failed check and print it (the run goes on; the exit status is 1)."""
        self.failures.append(msg)
        print(f"FAIL: {msg}", flush=True)

    def sync(self) -> None:
        """Wait for the device's queued work (a no-op on CPU)."""
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any], reps: int) -> float:
        """Median seconds of ``fn()`` over ``reps`` runs after one warm-up, the device synchronised around each."""
        fn()
        times = []
        for _ in range(reps):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
