"""Published speculator checkpoints through a real tritonserver (fixture ``server``, which serves one head of every
layout beside the one ``make speculator`` trains: tests/conftest.py), as users serve them: greedy output is the
target's for every head and k, a head with fewer positions than k drafts what it has, and a checkpoint that does not
fit fails draft_model's load with an error naming the file and the key while the rest keeps serving."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.generate import stream_generate
from tests.speculator_checkpoints.embedded import target_sizes
from tests.speculator_checkpoints.medusa import write_medusa
from tests.speculator_checkpoints.mlp import write_mlp_speculator

N_TOKENS = 64  # greedy_references (conftest.py) holds this many tokens per prompt
HEADS = ("eagle", "eagle3", "medusa", "mlp_speculator", "arctic")
POSITIONS = {"medusa": 3, "mlp_speculator": 3, "arctic": 3}  # what tests/speculator_checkpoints/embedded.py writes


def _check_greedy(url: str, refs, method: str, k: int) -> None:
    for prompt, ref in refs[:1]:  # one prompt: the unit tests (test_published_heads.py) cover more in process
        r = stream_generate(url, prompt, N_TOKENS, speculative_method=method, num_draft_tokens=k)
        assert r.output_ids == ref, (method, k, prompt[:60])
        steps, drafted = r.stats["num_steps"], r.stats["num_draft_tokens_total"]
        # every step after the first drafts (speculator_min_token_prob 0): at most k, and a chain at most the head's
        # positions; with k >= 2 the heads of POSITIONS draft trees (draft_tree's default): up to k nodes, each path
        # within the head's positions (tests/unit/proposers/test_medusa.py, test_mlp_speculator.py)
        cap = k if (k > 1 and method in POSITIONS) else min(k, POSITIONS.get(method, k))
        assert steps - 1 <= drafted <= cap * steps, (method, k, r.stats)


def _check_greedy_together(url: str, refs, methods, k: int) -> None:
    """:func:`_check_greedy` for each method, as concurrent streams (one batched round serves them all; each head
    alone: test_every_published_head_serves_the_target_s_greedy_output)."""
    with ThreadPoolExecutor(len(methods)) as pool:
        for f in [pool.submit(_check_greedy, url, refs, m, k) for m in methods]:
            f.result(timeout=600)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", HEADS)
def test_every_published_head_serves_the_target_s_greedy_output(server, greedy_references, method, k):
    _check_greedy(server.grpc_url, greedy_references, method, k)


def _draft_config(client) -> dict:
    return client.get_model_config("draft_model", as_json=True)["config"]


def _load_draft(client, config: dict, speculator_path: str, server) -> None:
    """Reload draft_model with ``config`` and another speculator_path (through the launcher, which holds the key the
    repository API asks for and tells its healer)."""
    cfg = json.loads(json.dumps(config))
    cfg.setdefault("parameters", {})["speculator_path"] = {"string_value": speculator_path}
    server.reload("draft_model", cfg)


def test_replaced_heads_serve_too(server, greedy_references, published_heads):
    """A published EAGLE-3 head given after ``auto`` replaces the trained one, and Arctic's LSTM speculator serves as
    ``arctic``; draft_model reloads with them (its config override) and the output stays the target's."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    original = _draft_config(client)
    before = original["parameters"]["speculator_path"]["string_value"]
    try:
        _load_draft(client, original, f"auto,{published_heads['eagle3']},{published_heads['arctic_lstm']}", server)
        _check_greedy_together(server.grpc_url, greedy_references, ("eagle3", "arctic"), 4)
    finally:
        _load_draft(client, original, before, server)


def test_published_variants_serve_too(server, greedy_references, published_heads):
    """Published variants in place of the served heads (draft_model reloaded with them): EAGLE-1 with q/k/v biases
    and HASS norms in vLLM's conversion script's layout, EAGLE-3 in the speculators library's layout with
    norm_before_fc and norm_before_residual, Medusa version 2 (projected by the target's LM head); each drafts and
    the output stays the target's."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    original = _draft_config(client)
    before = original["parameters"]["speculator_path"]["string_value"]
    variants = ",".join(str(published_heads[m]) for m in ("eagle_qwen2_hass", "eagle3_speculators", "medusa_v2"))
    try:
        _load_draft(client, original, variants, server)
        _check_greedy_together(server.grpc_url, greedy_references, ("eagle", "eagle3", "medusa"), 4)
    finally:
        _load_draft(client, original, before, server)


@pytest.fixture(scope="module")
def bad_heads(tmp_path_factory, real_model_dir):
    """Checkpoints that do not fit the embedded target, each with the file and key its load error must name: a weight
    of the wrong shape and an unknown architecture through the server (each a failed load of draft_model, ~12 s);
    every kind of misfit, the wrong vocabulary and a missing weight among them, in process:
    tests/unit/proposers/test_head_fit.py."""
    s, root = target_sizes(real_model_dir), tmp_path_factory.mktemp("bad-heads")
    unknown = write_mlp_speculator(root / "unknown", s["hidden"], s["vocab"])
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["FooSpeculatorForCausalLM"], "foo"
    (unknown / "config.json").write_text(json.dumps(cfg))
    return [
        (write_medusa(root / "hidden", 512, s["vocab"], num_heads=2), "medusa_lm_head.safetensors",
         "0.0.linear.weight"),
        (unknown, "config.json", "architectures"),
    ]


def test_a_checkpoint_that_does_not_fit_fails_the_load_naming_the_file_and_key(server, greedy_references, bad_heads):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    original = _draft_config(client)
    prompt, ref = greedy_references[0]
    for folder, file, key in bad_heads:
        with pytest.raises(InferenceServerException) as err:
            _load_draft(client, original, str(folder), server)
        message = str(err.value)
        assert file in message and repr(key) in message and str(folder) in message, message
        # the rest of the repository serves on, the draft model and its heads included
        for model in ("generate", "spec_step", "target_model", "verifier"):
            assert client.is_model_ready(model), model
        r = stream_generate(server.grpc_url, prompt, 16, speculative_method="eagle", num_draft_tokens=2)
        assert r.output_ids == ref[:16]

