"""Shared fixtures: tiny random models for unit tests, the real embedded model, and a real tritonserver."""

from __future__ import annotations

import os

# The verifier's Triton kernels run on CPU tensors under the interpreter; it must be set before they are defined.
# (The sm_90 compile check runs in a subprocess without it.)
os.environ.setdefault("TRITON_INTERPRET", "1")
# Two pytest workers share this machine's cores (Makefile: pytest -n 2). Torch's OpenMP threads, and those of every
# server process started here (they inherit the environment), sleep when idle instead of spinning, which would take
# the other worker's core for nothing; under the workers, each process computes on one thread (two processes' thread
# pairs on two cores wait on each other at every parallel region). Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite holds served and in-process output against transformers' own float32 forward (token for token, log-probs
# to 1e-5), so every server it starts runs float32 (DTYPE: spec_decode.launcher.prepare_repository applies it) and
# in-process ``dtype: auto`` resolves as on a CPU without native bfloat16 (_auto_dtype_follows_DTYPE). bfloat16's own
# contract, speculative greedy output = plain decoding's, is tested where a test asks for it:
# tests/unit/engine/test_batch_invariance.py and tests/integration/test_bfloat16.py.
os.environ.setdefault("DTYPE", "float32")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _auto_dtype_follows_DTYPE():
    """With ``DTYPE=float32`` (the suite's default), this process's ``dtype: auto`` sees no native bfloat16 on the
    CPU (:func:`spec_decode.engine.dtype_choice.cpu_bf16_flag` of the machine's /proc/cpuinfo gives None; a file a test
    names is still read)."""
    from spec_decode.engine import dtype_choice

    if os.environ["DTYPE"] != "float32":
        yield
        return
    real = dtype_choice.cpu_bf16_flag
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dtype_choice, "cpu_bf16_flag", lambda cpuinfo=None: None if cpuinfo is None else real(cpuinfo))
        yield


@pytest.fixture(autouse=True, scope="session")
def _no_machine_eagle_head(tmp_path_factory):
    """In this process ``speculator_path: auto`` finds no trained head, whether or not ``make speculator`` has built
    one on this machine (:func:`spec_decode.proposers.speculators.layouts.trained_head_dir` reads
    ``artifacts.default_eagle_dir``): a test that serves a head names its folder (servers started by tests are separate
    processes and still see the machine's)."""
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
def deep_lm():
    """A tiny random LlamaForCausalLM as tiny_lm but 6 layers deep (EAGLE-3's default layers 2, L // 2, L - 3 exist),
    eval mode, fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(6)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def deep_dir(deep_lm, tmp_path_factory):
    """deep_lm saved as a model folder."""
    path = tmp_path_factory.mktemp("deep") / "deep"
    deep_lm.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_heads(tiny_lm, tmp_path_factory):
    """A head of every published layout over the tiny target, random weights: method -> folder (EAGLE-1 as the
    authors publish it, EAGLE-3 reading layers [0, 1, 1], Medusa, MLP speculator, Arctic's MLP speculator). Serve them
    with ``tiny_heads_params``; a target scoring for the EAGLE-3 head returns the inputs of its layers 0 and 1
    (``CachedCausalLM(..., aux_layers=(0, 1))``)."""
    from tests.helpers import save_tiny_eagle
    from tests.speculator_checkpoints.arctic import write_arctic
    from tests.speculator_checkpoints.eagle import write_eagle3
    from tests.speculator_checkpoints.medusa import write_medusa
    from tests.speculator_checkpoints.mlp import write_mlp_speculator

    root = tmp_path_factory.mktemp("tiny-heads")
    return {"eagle": save_tiny_eagle(tiny_lm, root / "eagle"),
            "eagle3": write_eagle3(root / "eagle3", 32, 97, 4, 2, 64, 48, layer_ids=[0, 1, 1]),
            "medusa": write_medusa(root / "medusa", 32, 97),
            "mlp_speculator": write_mlp_speculator(root / "mlp_speculator", 32, 97),
            "arctic": write_arctic(root / "arctic", 32, 97)}


@pytest.fixture(scope="session")
def tiny_heads_params(tiny_heads, tiny_dir):
    """draft_model config parameters that serve every head of ``tiny_heads`` for the tiny target, drafting every
    slot."""
    return {"speculator_path": ",".join(str(f) for f in tiny_heads.values()), "target_model_path": str(tiny_dir),
            "speculator_min_token_prob": "0"}


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
    """An EAGLE-3 head of the embedded target (method ``eagle3``), trained by the tool at a tiny size (seconds; it
    drafts little, which is all the tests need: the output must be the target's whatever the drafts); trained once
    per test run (:func:`tests.helpers.built_once`)."""
    from spec_decode.training.speculator import main
    from tests.helpers import built_once

    def train(out):
        assert main(["--output", str(out), "--teacher-cache", str(teacher_cache), "--eval-prompts", "1",
                     "--eval-tokens", "8", "--stdlib-tokens", "400", "--humaneval-tasks", "3", "--seq-len", "64",
                     "--steps", "20", "--batch-size", "4", "--draft-vocab", "2048"]) == 0

    return built_once(tmp_path_factory, "eagle", train)


@pytest.fixture(scope="session")
def published_heads(tmp_path_factory, real_model_dir):
    """One head of every published layout for the embedded target (SmolLM2-135M: hidden 576, 9 attention heads, 3
    key/value heads, MLP 1536), random weights: name -> folder
    (:func:`tests.speculator_checkpoints.embedded.write_published_heads`: ``eagle`` is an EAGLE-1 head in its authors'
    layout, with the target's embedding; ``arctic_lstm`` a second Arctic head, not served by ``server``)."""
    from tests.speculator_checkpoints.embedded import write_published_heads

    return write_published_heads(tmp_path_factory.mktemp("published-heads"), real_model_dir)


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_eagle, published_heads):
    """A real tritonserver on free ports serving the repository; the target drafts for itself (method=draft), the tiny
    trained EAGLE-3 head serves method=eagle3, and a published-layout head of every other layout its method (eagle:
    EAGLE-1, medusa, mlp_speculator, arctic); the target returns the EAGLE-3 head's layers' hidden states beside its
    last one."""
    from spec_decode.launcher import draft_overrides, prepare_repository

    heads = [tiny_eagle] + [published_heads[m] for m in ("eagle", "medusa", "mlp_speculator", "arctic")]
    overrides = draft_overrides("default")
    overrides["draft_model"]["draft_min_token_prob"] = "0"  # the self-draft drafts every slot (all accepted)
    overrides["draft_model"]["speculator_path"] = ",".join(str(h) for h in heads)
    overrides["draft_model"]["speculator_min_token_prob"] = "0"  # the random heads are unsure: draft every slot
    log = tmp_path_factory.mktemp("triton") / "server.log"
    yield from _running_server(prepare_repository(overrides), log)


@pytest.fixture(scope="session")
def running_server():
    """For a fixture of its own server: ``yield from running_server(repository, log_path)``."""
    return _running_server
