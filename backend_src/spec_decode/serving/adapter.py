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


def read_inputs(request, names, pb_utils) -> dict:
    """Input tensors of a request by name: numpy arrays for CPU tensors, torch tensors for GPU ones; absent -> missing."""
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
    """Run ``backend.run(inputs) -> {name: array}`` for each request; a failing request gets an error response.

    Args:
        backend: object with ``INPUTS`` (input names) and ``run(dict) -> dict``.
        requests: the ``pb_utils.InferenceRequest`` list handed to ``execute``.
    """
    responses = []
    for request in requests:
        try:
            outputs = backend.run(read_inputs(request, backend.INPUTS, pb_utils))
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[to_pb_tensor(n, v, pb_utils) for n, v in outputs.items()])
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes this request's error response
            if not isinstance(exc, ValueError):
                logger.error("%s failed: %s", type(backend).__name__, traceback.format_exc())
            responses.append(error_response(exc, pb_utils))
    return responses
