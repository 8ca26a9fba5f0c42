"""What in a round would make the host wait for the GPU, found on a CPU.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` raises at each host synchronisation. A CPU has no such thing:
every tensor is already on the host, so ``.item()``, ``.tolist()`` or ``.cpu()`` cost nothing and say nothing.
:class:`SyncSentinel` stands in for it. It is told which tensors would live on the GPU (a model's parameters and
buffers, a KV pool), follows them through every operator (a ``TorchDispatchMode``: each result of an operator with
such an input lives there too, and so does the base of a view written with one) and records each read of one by
the host:

- the operators that wait for the device on CUDA: ``_local_scalar_dense`` (``.item()``, ``float(t)``, ``int(t)``,
  ``bool(t)``), ``nonzero``, ``masked_select``, ``unique`` and its variants, ``repeat_interleave`` without
  ``output_size``;
- copies to the host: ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu`` of such a tensor (on CUDA a
  device-to-host copy; on a CPU no operator runs, so the sentinel wraps these methods while it is active).

Each read is recorded with the first frame of the project's code that made it (file and line), so a test can say
where to move the work onto the device or into the round's one copy. A tensor made from host data (a list, a numpy
array) is a host tensor, even where the code would place it on the GPU: the sentinel finds reads, not uploads.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

SYNC_OPS = frozenset({"item", "_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                      "unique_dim", "unique_consecutive", "repeat_interleave"})
"""Operators that make the host wait for the device on CUDA (``repeat_interleave`` only without ``output_size``)."""

HOST_COPIES = ("tolist", "numpy", "cpu")
"""Tensor methods that copy a device tensor to the host."""

_HERE = Path(__file__).resolve()
_ROOT = _HERE.parents[2]


@dataclass(frozen=True)
class SyncEvent:
    """One host read of a device tensor: what (an operator or a host copy), where (``path:line`` of the project's
    code that made it, relative to the repository; ``?`` when none is on the stack) and in which function
    (``path:function``, stable across edits)."""

    what: str
    where: str
    function: str = "?"


def project_frame(skip: Path) -> tuple[Path, int, str] | None:
    """The innermost frame of the caller's stack in the repository's own code (not the virtual environment, not the
    file ``skip``): (its path relative to the repository, line, function), or None when there is none."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = Path(frame.filename)
        if path.is_relative_to(_ROOT) and path != skip and ".venv" not in path.parts:
            return path.relative_to(_ROOT), frame.lineno or 0, frame.name
    return None


def _event(what: str) -> SyncEvent:
    frame = project_frame(_HERE)
    if frame is None:
        return SyncEvent(what, "?")
    rel, line, name = frame
    return SyncEvent(what, f"{rel}:{line}", f"{rel}:{name}")


class SyncSentinel(TorchDispatchMode):
    """Records the host reads of tensors that would live on the GPU (module docstring), while active.

    Args:
        device_tensors: the tensors on the device to begin with (e.g. every parameter and buffer of the models and
            their KV pools: :func:`device_tensors_of`).

    Attributes:
        events: every :class:`SyncEvent`, in order.
    """

    def __init__(self, device_tensors: Iterable[torch.Tensor]):
        super().__init__()
        self._device = WeakTensorKeyDictionary()
        self._bases = WeakTensorKeyDictionary()  # view -> the tensor it views
        for t in device_tensors:
            self._device[t] = True
        self.events: list[SyncEvent] = []
        self._saved: dict[str, object] = {}

    def on_device(self, t: object) -> bool:
        """Whether ``t`` is a tensor that would live on the GPU."""
        return isinstance(t, torch.Tensor) and t in self._device

    def _tag(self, t: torch.Tensor) -> None:
        """``t`` holds device data, and so do the tensors it is a view of (written in place through it)."""
        while t is not None and not self.on_device(t):
            self._device[t] = True
            t = self._bases.get(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            self._bases[out] = args[0]  # inference tensors keep no ``_base``: the sentinel keeps it
        if any(self.on_device(t) for t in tree_leaves((args, kwargs))):
            name = func.overloadpacket.__name__
            if name in SYNC_OPS and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
                self.events.append(_event(name))
            written = [args[0]] if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) else []
            for t in [*tree_leaves(out), *written]:
                if isinstance(t, torch.Tensor):
                    self._tag(t)
        return out

    def __enter__(self):
        sentinel = self
        for name in HOST_COPIES:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(t, *a, _name=name, _original=original, **kw):
                if sentinel.on_device(t) and not (_name == "cpu" and t.device.type != "cpu"):
                    event = _event(_name)
                    last = sentinel.events[-1] if sentinel.events else None
                    # ``t.cpu().numpy()``: one copy (on a CPU ``cpu()`` returns the tensor itself, still tagged)
                    if not (_name != "cpu" and last is not None and last.what == "cpu" and last.where == event.where):
                        sentinel.events.append(event)
                out = _original(t, *a, **kw)
                if _name == "cpu" and out is t and sentinel.on_device(t):
                    # on a CPU ``cpu()`` returns the tensor itself; on CUDA it is a host copy: reads of it are free
                    out = t.clone()
                    del sentinel._device[out]
                return out

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def counts(self) -> Counter:
        """Events by (what, where)."""
        return Counter((e.what, e.where) for e in self.events)


DEVICE_HOLDERS = ("KVPool", "HeadKV")
"""Classes whose tensor attributes live on the model's device (the KV pools); other objects' tensors may be host
tensors by design (a pruned vocabulary's ids, pinned buffers) and are not taken as device tensors."""


def device_tensors_of(*objects: object) -> list[torch.Tensor]:
    """Every parameter and buffer of the ``torch.nn.Module`` objects reachable from ``objects`` (through the
    project's objects' attributes, dicts, lists and tuples, a few levels deep) and the tensors of the KV pools on the
    way (:data:`DEVICE_HOLDERS`): what would live on the GPU when these models run there."""
    out: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(x: object, depth: int, holder: bool = False) -> None:
        if id(x) in seen or depth > 6:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if holder:
                out[id(x)] = x
        elif isinstance(x, torch.nn.Module):
            for t in (*x.parameters(), *x.buffers()):
                out[id(t)] = t
        elif isinstance(x, dict):
            for v in x.values():
                visit(v, depth + 1, holder)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v, depth + 1, holder)
        elif hasattr(x, "__dict__") and type(x).__module__.split(".")[0] in ("spec_decode", "bench"):
            for v in vars(x).values():
                visit(v, depth + 1, type(x).__name__ in DEVICE_HOLDERS)

    for o in objects:
        visit(o, 0)
    return list(out.values())


ROUND_KINDS = {"plain": ("none", 0, False), "head chain, greedy": ("eagle3", 4, False),
               "draft LM chain, greedy": ("draft", 4, False), "head chain, sampled": ("eagle3", 4, True)}
"""The served rounds whose host reads are counted: kind -> (method, k, sampled)."""


def round_syncs(ensembles: dict, prompts: list[list[int]], cuda: bool, warm_rounds: int = 2,
                kinds: tuple[str, ...] = tuple(ROUND_KINDS), measure: bool = True) -> dict:
    """Host reads of one warm round of each kind of :data:`ROUND_KINDS` through ``ensembles`` (method ->
    :class:`~spec_decode.serving.local_ensemble.LocalEnsemble`), a batch of ``prompts`` (token ids) as new sequences,
    after ``warm_rounds`` rounds (so a head has hidden states).

    On a CPU (``cuda`` False) by :class:`SyncSentinel`; on CUDA by ``torch.cuda.set_sync_debug_mode("warn")``, each
    synchronising call a warning (its frame recorded as the warning reports it). ``kinds``: a subset of the kinds;
    ``measure`` False runs the rounds only (for :func:`.attention.attention_report`).

    Returns:
        kind -> {"reads": count, "by_function": {"what path:function": count}} (CPU) or {"syncs": count,
        "by_location": {"file:line": count}} (CUDA).
    """
    import warnings

    from spec_decode.protocol import StepInputs
    from spec_decode.sampling import SamplingParams

    out: dict = {}
    for n, (kind, (method, k, sampled)) in enumerate(ROUND_KINDS.items()):
        if kind not in kinds:
            continue
        ens = ensembles[method]
        params = SamplingParams(1.0 if sampled else 0.0, 0, 1.0, 7, seeded=True)
        ids = [list(p) for p in prompts]
        hidden: list = [None] * len(prompts)
        seqs = [3 * 10**9 + 100 * n + i for i in range(len(prompts))]
        for step in range(warm_rounds + 1):
            inps = [StepInputs(s, ids[i], k, method, params, step, hidden_states=hidden[i])
                    for i, s in enumerate(seqs)]
            if step < warm_rounds or not measure:
                results = ens.run_round(inps)
            elif cuda:
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        with torch.inference_mode():
                            results = ens.run_round(inps)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                by: Counter = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
                out[kind] = {"syncs": len(syncs), "by_location": dict(by.most_common())}
            else:
                sentinel = SyncSentinel(device_tensors_of(ens.target, ens.draft))
                with torch.inference_mode(), sentinel:
                    results = ens.run_round(inps)
                by_fn: Counter = Counter(f"{e.what} {e.function}" for e in sentinel.events)
                out[kind] = {"reads": len(sentinel.events), "by_function": dict(by_fn.most_common())}
            for i, r in enumerate(results):
                ids[i] += r.output_ids
                hidden[i] = r.hidden_states
        ens.release([StepInputs(s, ids[i], 0, method, params, warm_rounds + 1) for i, s in enumerate(seqs)])
    return out
__all__ = ["DEVICE_HOLDERS", "HOST_COPIES", "ROUND_KINDS", "SYNC_OPS", "SyncEvent", "SyncSentinel",
           "device_tensors_of", "project_frame", "round_syncs"]
