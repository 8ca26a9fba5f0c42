"""Shared fixtures: tiny random models for unit tests, the real embedded model, and a real tritonserver."""

from __future__ import annotations

import os

# The verifier's Triton kernels run on CPU tensors under the interpreter; it must be set before they are defined.
# (The sm_90 compile check runs in a subprocess without it.)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _no_machine_eagle_head(tmp_path_factory):
    """In this process ``eagle_path: auto`` finds no EAGLE head, whether or not ``make speculator`` has built one on
    this machine: a test that serves the head names its folder (servers started by tests are separate processes and
    still see the machine's)."""
    from spec_decode.proposers.eagle import artifacts

    missing = tmp_path_factory.mktemp("no-eagle") / "none"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(artifacts, "default_eagle_dir", lambda: missing)
        yield


@pytest.fixture(scope="session")
def tiny_lm():
    """A tiny random LlamaForCausalLM (vocabulary 97, 2 layers) in eval mode, fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_dir(tiny_lm, tmp_path_factory):
    """The tiny random Llama saved as a model folder (what the step models' settings name)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    tiny_lm.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def teacher_cache(tmp_path_factory):
    """Where the training tools' tests keep the target's teacher passes (shared by make draft's and make
    speculator's tests, as the real tools share theirs)."""
    return tmp_path_factory.mktemp("teacher")


@pytest.fixture(scope="session")
def real_model_dir():
    """Folder of the embedded default target (SmolLM2-135M-Instruct), converted once."""
    from spec_decode.engine.model_loading import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def real_tokenizer(real_model_dir):
    """The embedded target's tokenizer."""
    from spec_decode.engine.model_loading import load_tokenizer

    return load_tokenizer(real_model_dir)


@pytest.fixture(scope="session")
def real_model(real_model_dir):
    """The embedded target model, float32 on CPU."""
    from spec_decode.engine.model_loading import load_causal_lm

    return load_causal_lm(real_model_dir, torch.device("cpu"), torch.float32)


def _running_server(repo, log):
    """Generator for a fixture: a started, ready TritonServer on free ports; stopped afterwards, its log tail
    printed."""
    from spec_decode.launcher import TritonServer

    srv = TritonServer(repo, log_path=log)
    srv.start()
    try:
        srv.wait_ready(timeout=600)
        yield srv
    finally:
        srv.stop()
        print(f"\n--- tritonserver log tail ({log}) ---\n{srv.log_tail(40)}")


@pytest.fixture(scope="session")
def tiny_eagle(tmp_path_factory, teacher_cache, real_model_dir):
    """An EAGLE head of the embedded target, trained by the tool at a tiny size (seconds; it drafts little, which is
    all the tests need: the output must be the target's whatever the drafts)."""
    from spec_decode.training.speculator import main

    out = tmp_path_factory.mktemp("eagle") / "eagle"
    assert main(["--output", str(out), "--teacher-cache", str(teacher_cache), "--eval-prompts", "1", "--eval-tokens",
                 "8", "--stdlib-tokens", "400", "--humaneval-tasks", "3", "--seq-len", "64", "--steps",
                 "20", "--batch-size", "4", "--draft-vocab", "2048"]) == 0
    return out


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_eagle):
    """A real tritonserver on free ports serving the repository; the target drafts for itself (method=draft), and a
    tiny EAGLE head serves method=eagle."""
    from spec_decode.launcher import draft_overrides, prepare_repository

    overrides = draft_overrides("default")
    overrides["draft_model"]["draft_min_token_prob"] = "0"  # the self-draft drafts every slot (all accepted)
    overrides["draft_model"]["eagle_path"] = str(tiny_eagle)
    overrides["draft_model"]["eagle_min_token_prob"] = "0"  # the tiny one is unsure: draft every slot
    log = tmp_path_factory.mktemp("triton") / "server.log"
    yield from _running_server(prepare_repository(overrides), log)


@pytest.fixture(scope="session")
def running_server():
    """For a fixture of its own server: ``yield from running_server(repository, log_path)``."""
    return _running_server
