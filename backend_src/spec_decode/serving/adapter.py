"""The pb_utils boundary: tensors in and out of a backend, errors as Triton error responses.

CPU tensors cross as numpy (``as_numpy`` / ``pb_utils.Tensor``); GPU tensors as DLPack
(``to_dlpack`` / ``pb_utils.Tensor.from_dlpack``) so [k+1, V] probabilities never leave the device.
``pb_utils`` is passed in because it only exists inside the Python backend stub.
"""

from __future__ import annotations

import json
import logging
import time
import traceback

import numpy as np

from .wire import PAD_ID

logger = logging.getLogger(__name__)


def log_to_server(model: str) -> None:
    """Send the ``spec_decode`` loggers' records of level INFO and above to stderr as ``spec_decode <model>: <message>``
    lines (tritonserver's log carries a Python model's stderr); once per process."""
    root = logging.getLogger("spec_decode")
    if any(getattr(h, "spec_decode_server", False) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    handler.spec_decode_server = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(f"spec_decode {model}: %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def model_parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of a model's config.pbtxt as a name -> string_value dict, with the instance's device.

    An instance of kind GPU (``instance_group [ { kind: KIND_GPU gpus: [ n ] } ]``: Triton creates it for GPU n and
    passes ``model_instance_kind`` "GPU" and ``model_instance_device_id`` "n") gets ``device`` = ``cuda:n`` when its
    ``device`` parameter is ``auto`` or absent; a ``device`` set in config.pbtxt overrides the instance's. Instances
    of kind CPU or MODEL keep ``auto`` (CUDA when the process sees a GPU, else the CPU).

    Also sends the package's log records of level INFO and above to the process's stderr, which tritonserver's log
    shows (:func:`log_to_server`): what a model says at load (its dtype and why, its KV pool, its CUDA graphs).

    Args:
        args: the ``args`` dict Triton passes to ``initialize`` (its ``model_config`` is JSON).
    """
    log_to_server(str(args.get("model_name", "")))
    config = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    if str(args.get("model_instance_kind", "")).upper() == "GPU" and params.get("device", "").strip().lower() in (
            "", "auto"):
        params["device"] = f"cuda:{int(args.get('model_instance_device_id') or 0)}"
    return params


def sibling_parameters(args: dict, model: str) -> dict[str, str] | None:
    """The config.pbtxt ``parameters`` of another model of the same repository (name -> string value), or None when
    its config cannot be read (no such folder; tritonclient's protobuf definitions missing).

    Args:
        args: the ``args`` Triton passes to ``initialize`` (``model_repository`` is the model's own folder).
        model: the other model's name, e.g. ``draft_model``.

    Raises:
        ValueError: a config.pbtxt that does not parse.
    """
    from pathlib import Path

    own = Path(str(args.get("model_repository", "")))
    cfg = own.parent / model / "config.pbtxt"
    if not cfg.is_file():
        return None
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return None
    try:
        parsed = text_format.Parse(cfg.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ValueError(f"{cfg}: {e}") from None
    return {k: v.string_value for k, v in parsed.parameters.items()}


def request_parameters(request) -> dict:
    """A request's parameters (Triton's ``InferenceRequest.parameters()``, JSON) as a dict; {} when it has none."""
    try:
        raw = request.parameters()
    except AttributeError:
        return {}
    return json.loads(raw) if raw else {}


def read_inputs(request, names, pb_utils) -> dict:
    """Input tensors of a request by name (models without a batch dimension): numpy arrays for CPU tensors, torch
    tensors for GPU ones; absent -> missing."""
    out = {}
    for name in names:
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            continue
        if t.is_cpu():
            out[name] = t.as_numpy()
        else:
            import torch

            out[name] = torch.from_dlpack(t.to_dlpack())
    return out


def read_rows(request, names, pb_utils) -> list[dict]:
    """The sequences of a batched request (max_batch_size > 0): one inputs dict per row of the batch dimension.

    Rows of variable-length tensors are padded to a common length (token ids with ``PAD_ID`` at the end); the
    backends strip the padding (:func:`strip_padding`).

    Raises:
        ValueError: tensors whose batch dimensions differ.
    """
    whole = read_inputs(request, names, pb_utils)
    sizes = {name: int(v.shape[0]) for name, v in whole.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"every input needs the same batch dimension, got {sizes}")
    b = next(iter(sizes.values()), 1)
    return [{name: v[row] for name, v in whole.items()} for row in range(b)]


def strip_padding(ids) -> list[int]:
    """A row of token ids without its trailing ``PAD_ID`` padding, as a list of ints."""
    ids = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids).reshape(-1).astype(np.int64).tolist()
    while ids and ids[-1] == PAD_ID:
        ids.pop()
    return ids


def stack_rows(values: list):
    """Stack per-sequence outputs into one batched tensor, padding every dimension to the largest row.

    Integer tensors are padded with ``PAD_ID``, floating ones with 0. numpy rows give a numpy array; if any row is a
    torch tensor the result is torch, on the device of the first row that is on a GPU (else on the CPU): in a round
    mixing methods, the empty CPU draft_probs of an n-gram row must not pull a draft LM row's off its GPU.

    Args:
        values: one array or tensor per row, all of the same rank and dtype.

    Returns:
        [len(values), *max shape] array or tensor.
    """
    shape = tuple(max(int(v.shape[d]) for v in values) for d in range(values[0].ndim))
    if all(isinstance(v, np.ndarray) for v in values):
        pad = PAD_ID if np.issubdtype(values[0].dtype, np.integer) else 0
        out = np.full((len(values),) + shape, pad, dtype=values[0].dtype)
        for row, v in enumerate(values):
            out[(row,) + tuple(slice(0, n) for n in v.shape)] = v
        return out
    import torch

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    like = next((v for v in tensors if v.device.type != "cpu"), tensors[0])
    values = [torch.as_tensor(v, device=like.device) for v in values]  # some rows may be numpy (e.g. empty outputs)
    pad = 0 if values[0].is_floating_point() else PAD_ID
    stacked = torch.full((len(values),) + shape, pad, dtype=values[0].dtype, device=values[0].device)
    for row, v in enumerate(values):
        stacked[(row,) + tuple(slice(0, n) for n in v.shape)] = v
    return stacked


def to_pb_tensor(name: str, value, pb_utils):
    """numpy array or torch tensor -> ``pb_utils.Tensor`` (DLPack for CUDA tensors)."""
    if isinstance(value, np.ndarray):
        return pb_utils.Tensor(name, value)
    if value.device.type != "cpu":
        return pb_utils.Tensor.from_dlpack(name, value.contiguous())
    return pb_utils.Tensor(name, value.detach().contiguous().numpy())


def error_response(exc: BaseException, pb_utils, code=None):
    """A Triton error response carrying the exception's message (INVALID_ARG for ValueError by default)."""
    if code is None:
        code = pb_utils.TritonError.INVALID_ARG if isinstance(exc, ValueError) else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), code))


def execute(backend, requests, pb_utils) -> list:
    """Answer the requests handed to ``execute`` of a batched model (max_batch_size > 0).

    Every row of every request is one sequence: all rows go to the backend together, so sequences share forward
    passes whether they came in one request (a round of generate's steps) or in several (Triton's dynamic batcher).
    A request whose rows all succeed gets its outputs stacked back along the batch dimension (:func:`stack_rows`);
    a request with a failing row gets an error response (generate then retries that round's sequences one by one, so
    only the failing sequence fails); other requests are unaffected.

    Args:
        backend: object with ``INPUTS`` (input names) and ``run(dict) -> dict``, or ``run_batch(list[dict]) -> list``
            (outputs or exception per sequence).
        requests: the ``pb_utils.InferenceRequest`` list handed to ``execute``.

    Returns:
        one ``pb_utils.InferenceResponse`` per request, in order: its outputs, or an error response (INVALID_ARG for
        a ValueError, INTERNAL otherwise, logged with its traceback).

    A backend with ``IO_METRIC`` (a counter name) and ``metrics`` gets the seconds spent reading the request tensors
    (``stage=decode_inputs``) and building the response tensors (``stage=encode_outputs``) added to it.
    """
    t0 = time.perf_counter()
    rows: list = []  # every sequence of every request
    spans: list = []  # per request: (first row, row count) or the exception that fails it
    for request in requests:
        try:
            r = read_rows(request, backend.INPUTS, pb_utils)
            spans.append((len(rows), len(r)))
            rows += r
        except Exception as exc:  # noqa: BLE001
            spans.append(exc)
    t1 = time.perf_counter()
    if hasattr(backend, "run_batch"):
        outs = list(backend.run_batch(rows)) if rows else []
    else:
        outs = []
        for inputs in rows:
            try:
                outs.append(backend.run(inputs))
            except Exception as exc:  # noqa: BLE001 - every failure becomes its request's error response
                outs.append(exc)
    t2 = time.perf_counter()
    responses = []
    for span in spans:
        if not isinstance(span, Exception):
            mine = outs[span[0]:span[0] + span[1]]
            span = next((o for o in mine if isinstance(o, Exception)), None)
        if span is None:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    to_pb_tensor(name, stack_rows([o[name] for o in mine]), pb_utils) for name in mine[0]]))
                continue
            except Exception as exc:  # noqa: BLE001
                span = exc
        if not isinstance(span, ValueError):
            logger.error("%s failed: %s", type(backend).__name__,
                         "".join(traceback.format_exception(type(span), span, span.__traceback__)))
        responses.append(error_response(span, pb_utils))
    io_metric = getattr(backend, "IO_METRIC", None)
    if io_metric is not None and getattr(backend, "metrics", None) is not None:
        backend.metrics.add(io_metric, t1 - t0, stage="decode_inputs")
        backend.metrics.add(io_metric, time.perf_counter() - t2, stage="encode_outputs")
    return responses
