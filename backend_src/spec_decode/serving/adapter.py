"""The pb_utils boundary: tensors in and out of a backend, errors as Triton error responses.

CPU tensors cross as numpy (``as_numpy`` / ``pb_utils.Tensor``); GPU tensors as DLPack
(``to_dlpack`` / ``pb_utils.Tensor.from_dlpack``) so [k+1, V] probabilities never leave the device.
``pb_utils`` is passed in because it only exists inside the Python backend stub.
"""

from __future__ import annotations

import json
import logging
import traceback

import numpy as np

logger = logging.getLogger(__name__)


def model_parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of a model's config.pbtxt as a name -> string_value dict.

    Args:
        args: the ``args`` dict Triton passes to ``initialize`` (its ``model_config`` is JSON).
    """
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def config_param(params: dict[str, str], name: str, default):
    """A config.pbtxt parameter converted to the type of ``default`` (``default`` when absent or empty).

    Raises:
        ValueError: naming the parameter when its value does not convert.
    """
    value = str(params.get(name, "")).strip()
    if not value:
        return default
    try:
        return type(default)(value)
    except ValueError:
        raise ValueError(f"config parameter {name!r}: expected {type(default).__name__}, got {value!r}") from None


def read_inputs(request, names, pb_utils, batched: bool = False) -> dict:
    """Input tensors of a request by name: numpy arrays for CPU tensors, torch tensors for GPU ones; absent -> missing.

    Args:
        batched: the model has max_batch_size > 0 and a request carries one sequence: the leading batch dimension
            (of size 1) is removed.

    Raises:
        ValueError: (batched) a tensor whose batch dimension is not 1.
    """
    out = {}
    for name in names:
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            continue
        if t.is_cpu():
            value = t.as_numpy()
        else:
            import torch

            value = torch.from_dlpack(t.to_dlpack())
        if batched:
            if value.shape[0] != 1:
                raise ValueError(f"input '{name}': one sequence per request (batch dimension 1), got shape "
                                 f"{list(value.shape)}")
            value = value[0]
        out[name] = value
    return out


def to_pb_tensor(name: str, value, pb_utils, batched: bool = False):
    """numpy array or torch tensor -> ``pb_utils.Tensor`` (DLPack for CUDA tensors); ``batched`` adds the leading
    batch dimension of 1 (models with max_batch_size > 0)."""
    if batched:
        value = value[None]
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


def execute(backend, requests, pb_utils, batched: bool = True) -> list:
    """Answer the requests handed to ``execute``; a failing request gets an error response, the others their outputs.

    Args:
        backend: object with ``INPUTS`` (input names) and ``run(dict) -> dict``, or ``run_batch(list[dict]) -> list``
            (outputs or exception per request) to serve the requests Triton's dynamic batcher groups together at once.
        requests: the ``pb_utils.InferenceRequest`` list handed to ``execute``.
        batched: the model has max_batch_size > 0: every request carries one sequence with a leading batch dimension
            of 1, removed from the inputs and added to the outputs.
    """
    results: list = []
    for request in requests:
        try:
            results.append(read_inputs(request, backend.INPUTS, pb_utils, batched))
        except Exception as exc:  # noqa: BLE001
            results.append(exc)
    ready = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
    if hasattr(backend, "run_batch"):
        for i, out in zip(ready, backend.run_batch([results[i] for i in ready])):
            results[i] = out
    else:
        for i in ready:
            try:
                results[i] = backend.run(results[i])
            except Exception as exc:  # noqa: BLE001 - every failure becomes this request's error response
                results[i] = exc
    responses = []
    for r in results:
        if isinstance(r, Exception):
            if not isinstance(r, ValueError):
                logger.error("%s failed: %s", type(backend).__name__,
                             "".join(traceback.format_exception(type(r), r, r.__traceback__)))
            responses.append(error_response(r, pb_utils))
        else:
            try:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[to_pb_tensor(n, v, pb_utils, batched) for n, v in r.items()]))
            except Exception as exc:  # noqa: BLE001
                responses.append(error_response(exc, pb_utils))
    return responses
