"""spec_decode.serving.wire: every config.pbtxt declares exactly the tensors the wire module names (inputs, outputs,
dtypes, dims, optional and ragged flags) and each ensemble's maps are the ones its rule derives; the one scalar decoder
checks size and dtype kind."""

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from spec_decode.launcher import DEFAULT_REPOSITORY, MODELS
from spec_decode.serving import wire
from spec_decode.settings import InvalidInputError


def _config(model: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((DEFAULT_REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def _dtype(value: int) -> str:
    return model_config_pb2.DataType.Name(value).removeprefix("TYPE_")


def test_the_wire_module_covers_every_model_the_launcher_serves():
    assert set(wire.MODELS) == set(MODELS)


def test_generate_trtllm_is_generate_batched_by_one_and_decoupled():
    """NVIDIA's OpenAI frontend sends [1, 1] tensors: generate_trtllm declares generate's tensors per row with
    max_batch_size 1, decoupled as generate; generate itself keeps max_batch_size 0 (its clients send [1])."""
    trtllm, generate = _config(wire.GENERATE_TRTLLM), _config(wire.GENERATE)
    assert (trtllm.max_batch_size, generate.max_batch_size) == (1, 0)
    assert trtllm.model_transaction_policy.decoupled and generate.model_transaction_policy.decoupled
    assert list(trtllm.input) == list(generate.input) and list(trtllm.output) == list(generate.output)
    assert not trtllm.HasField("dynamic_batching")  # one request per row: nothing to batch


@pytest.mark.parametrize("model", sorted(wire.MODELS))
def test_config_inputs_and_outputs_are_the_wire_module_s(model):
    cfg, spec = _config(model), wire.MODELS[model]
    got_in = [(t.name, _dtype(t.data_type), tuple(t.dims), t.optional, t.allow_ragged_batch) for t in cfg.input]
    want_in = [(t.name, t.dtype, t.dims, t.optional, t.ragged) for t in spec.inputs]
    assert got_in == want_in
    got_out = [(t.name, _dtype(t.data_type), tuple(t.dims)) for t in cfg.output]
    assert got_out == [(t.name, t.dtype, t.dims) for t in spec.outputs]


@pytest.mark.parametrize("ensemble", [m for m, w in wire.MODELS.items() if w.steps])
def test_ensemble_maps_are_the_ones_the_rule_derives(ensemble):
    steps = _config(ensemble).ensemble_scheduling.step
    got = [(s.model_name, dict(s.input_map), dict(s.output_map)) for s in steps]
    assert got == wire.ensemble_maps(ensemble)


def test_the_rule_keeps_ensemble_outputs_and_hides_the_rest():
    (_, _, draft_out), (_, target_in, target_out), (_, verifier_in, _) = wire.ensemble_maps(wire.SPEC_STEP)
    assert draft_out == {"draft_token_ids": "draft_token_ids", "draft_probs": "_draft_probs",
                         "draft_parents": "draft_parents"}
    assert target_in["draft_token_ids"] == "draft_token_ids" and target_out["target_probs"] == "_target_probs"
    assert verifier_in["draft_probs"] == "_draft_probs"
    (_, _, _), (_, score_verifier_in, _) = wire.ensemble_maps(wire.SCORE_STEP)
    assert score_verifier_in["draft_probs"] == "draft_probs"  # score_step takes the (empty) drafts as inputs
    with pytest.raises(KeyError, match="not an ensemble"):
        wire.ensemble_maps("verifier")


def test_the_scalar_decoder_checks_presence_size_and_dtype_kind():
    assert wire.scalar({"step": np.array([4], np.int64)}, "step") == 4
    assert wire.scalar({"step": torch.tensor([9])}, "step") == 9  # an input left on the GPU arrives as torch
    assert wire.scalar({}, "step", 0) == 0
    with pytest.raises(InvalidInputError, match=r"'sequence_id': required \(UINT64 \[1\]\)"):
        wire.scalar({}, "sequence_id")
    with pytest.raises(InvalidInputError, match=r"'temperature': expected one FP32 value, got shape \[2\]"):
        wire.scalar({"temperature": np.array([0.5, 0.5], np.float32)}, "temperature")
    with pytest.raises(InvalidInputError, match="'temperature': expected FP32, got dtype int64"):
        wire.scalar({"temperature": np.array([1], np.int64)}, "temperature")
    with pytest.raises(InvalidInputError, match="'text_input': expected string"):
        wire.scalar({"text_input": np.array([1.0])}, "text_input", None, wire.CLIENT)
    assert wire.scalar({"stream": np.array([1], np.int32)}, "stream", None, wire.CLIENT) == 1  # BOOL takes 0/1
    assert wire.scalar({"num_input_tokens": np.array([7], np.uint32)}, "num_input_tokens", None, wire.CLIENT) == 7
    assert wire.CLIENT["num_output_tokens"].numpy_dtype is np.uint32


def test_the_text_decoder_decodes_utf8_and_returns_the_default_as_given():
    assert wire.text({"text_input": np.array(["é".encode()], object)}, "text_input", tensors=wire.CLIENT) == "é"
    assert wire.text({}, "acceptance_method", None, wire.CLIENT) is None
    with pytest.raises(InvalidInputError, match=r"'text_input': required \(STRING \[1\]\)"):
        wire.text({}, "text_input", tensors=wire.CLIENT)
    with pytest.raises(InvalidInputError, match="'speculative_method': not valid UTF-8"):
        wire.text({"speculative_method": np.array([b"\xff"], object)}, "speculative_method")


def test_encoded_rounds_travel_in_their_wire_dtypes():
    from spec_decode.protocol import StepInputs
    from spec_decode.sampling import SamplingParams
    from spec_decode.serving.round_codec import encode_round

    inps = [StepInputs(7, [1, 2, 3], 2, "ngram", SamplingParams(0.5, seed=3), 1),
            StepInputs(8, [4], 0, "none", SamplingParams(), 0)]
    for release in (False, True):
        for name, value in encode_round(inps, release).items():
            assert value.dtype == wire.STEP[name].numpy_dtype, name
            assert value.ndim == 1 + len(wire.STEP[name].dims), name
