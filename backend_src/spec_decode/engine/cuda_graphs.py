"""CUDA graphs of the paged forward (:class:`~.paged_forward.PagedForward`): captured once per round shape at load,
replayed each round (vLLM v1's ``CudagraphDispatcher``, SGLang's ``CudaGraphRunner``, gpt-fast's
``mode="reduce-overhead"``).

Every captured shape reads its inputs from one static device buffer, which a round fills with one non-blocking copy
from a pinned host buffer (:func:`~.paged_forward.pack_round`'s layout); the graph's outputs are static tensors that the
next replay overwrites, so callers copy what they keep. Shapes are captured largest first into one shared memory pool
(the smaller graphs reuse the largest one's activations). The inputs at capture are zeros: every row writes and reads
the trash page, so capture changes no sequence's keys and values.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
import torch

from .paged_forward import BATCH_BUCKETS, PagedForward, RoundShape, bucket, unpack_round

logger = logging.getLogger(__name__)

GRAPH_QUERIES = (1, 2, 3, 5, 9)  # query lengths captured (k + 1 for k = 0, 1, 2, 4, 8)
GRAPH_CONTEXTS = (512, 1024, 2048, 4096, 8192)  # key positions captured (larger contexts run eagerly)
# draft trees (root + nodes) captured, at batches up to GRAPH_TREE_BATCH; larger trees and batches run eagerly
GRAPH_TREE_QUERIES = (9, 17)
GRAPH_TREE_BATCH = 8
CUDA_GRAPHS = ("auto", "on", "emulate", "off")
"""The values of the ``cuda_graphs`` setting (:func:`round_graphs`)."""


def capture_shapes(batches: Iterable[int], queries: Iterable[int], pages: Iterable[int],
                   tree: bool = False) -> list[RoundShape]:
    """The shapes to capture: every (B, Q, P) with O = Q output rows (a captured round returns every query row; the
    caller keeps those it asked for), tree rounds (with ``parents``) when ``tree``, largest first."""
    shapes = [RoundShape(b, q, q, p, tree) for b in batches for q in queries for p in pages]
    return sorted(shapes, key=lambda s: (s.batch * s.query * s.pages, s.batch, s.query), reverse=True)


def smallest_shape(shapes: Iterable[RoundShape], batch: int, query: int, outputs: int,
                   pages: int, tree: bool = False) -> RoundShape | None:
    """The smallest of ``shapes`` (fewest input elements) that holds a round of ``batch`` rows, ``query`` new tokens,
    ``outputs`` output rows (a captured shape returns ``query`` rows per row) and ``pages`` block-table pages per row,
    a tree round's among the tree shapes only, or None (the round runs eagerly)."""
    best = None
    for s in shapes:
        if s.tree == tree and s.batch >= batch and s.query >= max(query, outputs) and s.pages >= pages:
            if best is None or s.numel() < best.numel():
                best = s
    return best


class CapturedForward:
    """CUDA graphs of ``forward``, one per shape.

    Args:
        forward: the paged forward (its pool and model on ``device``).
        shapes: the round shapes to capture (:func:`capture_shapes`).
        device: the CUDA device.

    Raises:
        RuntimeError: from CUDA while capturing (a forward that synchronises with the host cannot be captured).
    """

    def __init__(self, forward: PagedForward, shapes: list[RoundShape], device: torch.device):
        self.forward, self.device = forward, device
        self.shapes = list(shapes)
        size = max(s.numel() for s in self.shapes)
        self._host = torch.zeros(size, dtype=torch.int64).pin_memory()
        self._static = torch.zeros(size, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event()
        self._graphs: dict[RoundShape, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape (largest first, one memory pool); records :attr:`capture_seconds` and
        :attr:`capture_bytes` (the device memory reserved meanwhile) and logs them.

        Raises:
            RuntimeError: a shape's warm-up or capture failed: names the shape, how many were captured, and the
                exception (chained).
        """
        t0, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for shape in self.shapes:
            try:
                inputs = unpack_round(self._static[: shape.numel()], shape)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: kernels chosen, workspaces allocated, outside the graph
                        self.forward.run(inputs)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward.run(inputs)
            except Exception as exc:
                raise RuntimeError(f"CUDA graph capture of {shape} failed ({len(self._graphs)} of "
                                   f"{len(self.shapes)} shapes captured): {type(exc).__name__}: {exc}") from exc
            self._graphs[shape] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("CUDA graphs: captured %d round shapes (batch %s, query %s, pages %s) in %.1f s, %.0f MiB",
                    len(self._graphs), sorted({s.batch for s in self.shapes}), sorted({s.query for s in self.shapes}),
                    sorted({s.pages for s in self.shapes}), self.capture_seconds, self.capture_bytes / 2**20)

    def __len__(self) -> int:
        return len(self._graphs)

    def shape_for(self, batch: int, query: int, outputs: int, pages: int, tree: bool = False) -> RoundShape | None:
        """The captured shape a round runs at (:func:`smallest_shape` over the captured ones), or None."""
        return smallest_shape(self._graphs, batch, query, outputs, pages, tree)

    def run(self, packed: np.ndarray, shape: RoundShape) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay ``shape``'s graph on a packed round (:func:`~.paged_forward.pack_round` at ``shape``); returns
        its static (logits [B, Q, V], hidden [B, Q, H']), valid until the next replay."""
        graph, out = self._graphs[shape]
        n = shape.numel()
        self._copied.synchronize()  # the previous round's copy has left the pinned buffer
        self._host[:n].copy_(torch.from_numpy(packed))
        self._static[:n].copy_(self._host[:n], non_blocking=True)
        self._copied.record()
        graph.replay()
        return out


def planned_shapes(max_sequences: int, max_positions: int, page_size: int) -> list[RoundShape]:
    """The round shapes a model captures at load, largest first: batches 1, 2, 4, ... up to ``max_sequences``'s
    bucket, query lengths :data:`GRAPH_QUERIES`, contexts :data:`GRAPH_CONTEXTS` up to ``max_positions`` (0: no
    bound), and tree rounds of :data:`GRAPH_TREE_QUERIES` positions at batches up to :data:`GRAPH_TREE_BATCH`."""
    limit = max_positions or max(GRAPH_CONTEXTS)
    contexts = [c for c in GRAPH_CONTEXTS if c <= max(limit, GRAPH_CONTEXTS[0])]
    batches = [b for b in BATCH_BUCKETS if b <= bucket(max_sequences, BATCH_BUCKETS)]
    pages = [-(-c // page_size) for c in contexts]
    shapes = capture_shapes(batches, GRAPH_QUERIES, pages)
    shapes += capture_shapes([b for b in batches if b <= GRAPH_TREE_BATCH], GRAPH_TREE_QUERIES, pages, tree=True)
    shapes.sort(key=lambda s: (s.batch * s.query * s.pages, s.batch, s.query), reverse=True)  # largest first
    return shapes


class EagerAtShapes:
    """A stand-in for :class:`CapturedForward` on any device (``cuda_graphs: emulate``): the same planned shapes
    and the same choice of shape per round, each such round run eagerly at that shape, padded rows and pages
    included, exactly as its graph would run it (no ``span``, no per-path attention). So a CPU runs the code that
    replays graphs on CUDA: the packing at a captured shape, the padded rows' trash page, the output rows cut back.
    Nothing is captured (``capture_seconds`` and ``capture_bytes`` stay 0).

    Args:
        forward: the paged forward.
        shapes: the round shapes a capture would plan (:func:`planned_shapes`).
        device: where the forward runs.
    """

    def __init__(self, forward: PagedForward, shapes: list[RoundShape], device: torch.device):
        self.forward, self.device = forward, device
        self.shapes = list(shapes)
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def __len__(self) -> int:
        return len(self.shapes)

    def shape_for(self, batch: int, query: int, outputs: int, pages: int, tree: bool = False) -> RoundShape | None:
        """The shape a graph would replay the round at (:func:`smallest_shape`), or None."""
        return smallest_shape(self.shapes, batch, query, outputs, pages, tree)

    def run(self, packed: np.ndarray, shape: RoundShape) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a packed round at ``shape``: (logits [B, Q, V], hidden [B, Q, H']), as a replay returns."""
        flat = torch.from_numpy(packed).to(self.device)
        return self.forward.run(unpack_round(flat, shape))


def round_graphs(mode: str, forward: PagedForward, device: torch.device, max_sequences: int, max_positions: int,
                 page_size: int) -> CapturedForward | EagerAtShapes | None:
    """What runs a model's rounds at captured shapes for ``cuda_graphs: mode`` (:data:`CUDA_GRAPHS`): the graphs
    captured at load on CUDA (``auto``; ``on``: strictly), the eager stand-in (``emulate``, any device) or None
    (``off``, or ``auto``/``on`` off CUDA: every round eager).

    Raises:
        RuntimeError: ``on`` and a capture failed (:func:`capture_rounds`).
    """
    if mode == "emulate":
        return EagerAtShapes(forward, planned_shapes(max_sequences, max_positions, page_size), device)
    if device.type == "cuda" and mode != "off":
        return capture_rounds(forward, device, max_sequences, max_positions, page_size, strict=mode == "on")
    return None


def capture_rounds(forward: PagedForward, device: torch.device, max_sequences: int, max_positions: int,
                   page_size: int, strict: bool = False) -> CapturedForward | None:
    """The graphs a model captures at load (:func:`planned_shapes`); None when capture fails (logged: every round
    then runs eagerly, as with ``cuda_graphs: off``).

    Raises:
        RuntimeError: ``strict`` (``cuda_graphs: on``) and a shape's capture failed (the message names the shape and
            the exception).
    """
    graphs = CapturedForward(forward, planned_shapes(max_sequences, max_positions, page_size), device)
    try:
        graphs.capture()
    except Exception:  # noqa: BLE001 - a model whose forward cannot be captured still serves, eagerly
        if strict:
            raise
        logger.exception("CUDA graphs: capture failed; every round runs eagerly (cuda_graphs: off hides this)")
        return None
    return graphs


__all__ = ["GRAPH_CONTEXTS", "GRAPH_QUERIES", "GRAPH_TREE_BATCH", "GRAPH_TREE_QUERIES", "CapturedForward",
           "CUDA_GRAPHS", "EagerAtShapes", "capture_rounds", "capture_shapes", "planned_shapes", "round_graphs",
           "smallest_shape"]
