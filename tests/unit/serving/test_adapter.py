"""spec_decode.serving.adapter: the pb_utils boundary (rows in, rows out; errors as responses) and the instance's
device."""

from __future__ import annotations

import numpy as np
import torch

from spec_decode.launcher import DEFAULT_REPOSITORY
from spec_decode.serving.adapter import PAD_ID, execute, stack_rows, strip_padding
from tests.fake_pb_utils import FakePbUtils, Request


def test_stack_rows_pads_and_strip_padding_recovers_rows():
    rows = [np.array([5, 6, 7], np.int64), np.zeros(0, np.int64), np.array([9], np.int64)]
    stacked = stack_rows(rows)
    assert stacked.shape == (3, 3) and stacked[1].tolist() == [PAD_ID] * 3
    assert [strip_padding(r) for r in stacked] == [[5, 6, 7], [], [9]]
    probs = stack_rows([torch.ones(2, 4), np.zeros((0, 0), np.float32)])  # numpy rows join torch ones
    assert isinstance(probs, torch.Tensor) and probs.shape == (2, 2, 4) and probs[1].abs().sum() == 0


def test_stack_rows_keeps_a_device_row_on_its_device_whatever_comes_first():
    # "meta" stands in for a GPU here: a row off the CPU, after the CPU zeros of rows without draft probabilities
    device_row = torch.ones(2, 4, device="meta")
    out = stack_rows([torch.zeros(0, 0), np.zeros((0, 0), np.float32), device_row])
    assert out.device.type == "meta" and out.shape == (3, 2, 4)


class _EchoBackend:
    """Doubles each row's ids; a row with id 13 fails."""

    INPUTS = ("ids",)

    def __init__(self):
        self.batches = []

    def run_batch(self, rows):
        self.batches.append(len(rows))
        return [ValueError("13 is unlucky") if 13 in strip_padding(r["ids"]) else
                {"out": np.asarray(strip_padding(r["ids"]), np.int64) * 2} for r in rows]


def test_execute_runs_every_row_of_every_request_together_and_fails_only_the_request_with_a_bad_row():
    be = _EchoBackend()
    req = lambda rows: Request(ids=stack_rows([np.asarray(r, np.int64) for r in rows]))  # noqa: E731
    responses = execute(be, [req([[1, 2], [3]]), req([[13]]), req([[4, 5, 6]])], FakePbUtils)
    assert be.batches == [4]  # one run_batch over the 4 sequences of 3 requests
    first = responses[0].output_tensors[0].arr
    assert [strip_padding(r) for r in first] == [[2, 4], [6]]
    assert responses[1].has_error() and "unlucky" in responses[1].error().message()
    assert [strip_padding(r) for r in responses[2].output_tensors[0].arr] == [[8, 10, 12]]


def test_execute_times_decoding_and_encoding_into_the_backend_s_io_counter():
    from spec_decode.serving.metrics import Metrics

    be = _EchoBackend()
    be.IO_METRIC, be.metrics = "spec_decode_target_model_io_seconds_total", Metrics()
    req = Request(ids=stack_rows([np.asarray([1, 2], np.int64)]))
    for _ in range(2):  # a second call adds to the same two series
        execute(be, [req], FakePbUtils)
        keys = {dict(labels)["stage"] for name, labels in be.metrics.values if name == be.IO_METRIC}
        assert keys == {"decode_inputs", "encode_outputs"}
    assert be.metrics.get(be.IO_METRIC, stage="decode_inputs") > 0 and be.metrics.get(be.IO_METRIC,
                                                                                        stage="encode_outputs") > 0


def test_read_rows_rejects_inputs_with_different_batch_dimensions():
    be = _EchoBackend()
    be.INPUTS = ("ids", "other")
    bad = Request(ids=np.zeros((2, 3), np.int64), other=np.zeros((3, 1), np.int64))
    (resp,) = execute(be, [bad], FakePbUtils)
    assert resp.has_error() and "batch dimension" in resp.error().message()


def _init_args(model: str, kind: str, device_id: str) -> dict:
    """The args Triton's Python backend passes to initialize(): the model's config as JSON and its instance."""
    import json

    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse((DEFAULT_REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return {"model_config": json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True)),
            "model_instance_kind": kind, "model_instance_device_id": device_id, "model_instance_name": f"{model}_0"}


def test_a_gpu_instance_places_the_step_models_on_its_gpu_and_a_configured_device_overrides():
    import json

    from spec_decode.serving.adapter import model_parameters

    for model in ("target_model", "draft_model"):
        assert model_parameters(_init_args(model, "GPU", "3"))["device"] == "cuda:3"
        assert model_parameters(_init_args(model, "GPU", "0"))["device"] == "cuda:0"
        assert model_parameters(_init_args(model, "CPU", "0"))["device"] == "auto"  # the shipped default
        assert model_parameters(_init_args(model, "MODEL", "0"))["device"] == "auto"
        args = _init_args(model, "GPU", "1")
        cfg = json.loads(args["model_config"])
        cfg["parameters"]["device"] = {"string_value": "cuda:0"}
        args["model_config"] = json.dumps(cfg)
        assert model_parameters(args)["device"] == "cuda:0"  # config.pbtxt's device wins
        cfg["parameters"]["device"] = {"string_value": "cpu"}
        args["model_config"] = json.dumps(cfg)
        assert model_parameters(args)["device"] == "cpu"
