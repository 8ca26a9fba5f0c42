"""One fake of ``triton_python_backend_utils`` for the unit tests: the parts the models' code uses.

The real module exists only inside the Python backend's stub process. :class:`FakePbUtils` stands for it (pass the class
where the code takes ``pb_utils``); tests that need BLS calls or model readiness subclass it and set
``InferenceRequest.respond`` or ``is_model_ready``. :class:`Request` is a request as Triton hands it to ``execute``.
"""

from __future__ import annotations

import numpy as np

FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Tensor:
    """A CPU tensor: ``name`` and a numpy array."""

    def __init__(self, name, arr):
        self.name, self.arr = name, np.asarray(arr) if not isinstance(arr, np.ndarray) else arr

    def is_cpu(self):
        return True

    def as_numpy(self):
        return self.arr


class TritonError:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code=INTERNAL):
        self._message, self.code = message, code

    def message(self):
        return self._message


class InferenceResponse:
    """A response: ``output_tensors`` (also by name in ``outputs``) or an error (``error()``, as pb_utils)."""

    def __init__(self, output_tensors=None, error=None):
        self.output_tensors = list(output_tensors or [])
        self.outputs = {t.name: t.arr for t in self.output_tensors}
        self._error = error

    def error(self):
        return self._error

    def has_error(self):
        return self._error is not None


class Metric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v


class MetricFamily:
    """Records every family made (``created``) with its metrics."""

    COUNTER, GAUGE = "counter", "gauge"
    created: list = []

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        MetricFamily.created.append(self)

    def Metric(self, labels):  # noqa: N802 - pb_utils' name
        m = Metric(labels)
        self.metrics.append(m)
        return m


def exported(families=None) -> dict:
    """(metric name, sorted label items) -> value, over the families made (or ``families``)."""
    return {(f.name, tuple(sorted(x.labels.items()))): x.value for f in (families or MetricFamily.created)
            for x in f.metrics}


class Sender:
    """A decoupled model's response sender: records (response, flags); the test sets ``cancelled``."""

    def __init__(self):
        self.sent, self.cancelled = [], False

    def send(self, response=None, flags=0):
        assert not (self.sent and self.sent[-1][1] == FINAL), "a response was sent after the final one"
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


class Request:
    """A request as ``execute`` gets it: input arrays by name, and a response sender."""

    def __init__(self, **inputs):
        self.inputs, self.sender = inputs, Sender()

    def get_response_sender(self):
        return self.sender


class InferenceRequest:
    """A BLS request the code makes; ``async_exec`` answers with ``respond(self)`` (set by the test), and every
    request made is kept in ``sent``."""

    sent: list = []
    respond = None

    def __init__(self, model_name, inputs, requested_output_names):
        self.model, self.outputs = model_name, list(requested_output_names)
        self.inputs = {t.name: t.arr for t in inputs}
        type(self).sent.append(self)

    async def async_exec(self):
        return type(self).respond(self)


class FakePbUtils:
    """Stands for the ``triton_python_backend_utils`` module."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    Tensor, TritonError, InferenceResponse, MetricFamily, InferenceRequest = (
        Tensor, TritonError, InferenceResponse, MetricFamily, InferenceRequest)

    @staticmethod
    def get_input_tensor_by_name(request, name):
        arr = request.inputs.get(name)
        return None if arr is None else Tensor(name, arr)

    @staticmethod
    def get_output_tensor_by_name(response, name):
        """None for an output the response lacks, as pb_utils."""
        return Tensor(name, response.outputs[name]) if name in response.outputs else None
