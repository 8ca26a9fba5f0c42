"""``--model``: a new user's own model in one flag, through the real launcher, tritonserver and the OpenAI frontend. A
tiny random Llama over the embedded tokenizer is written into a temporary Hugging Face cache in its real layout and
served by its id (offline: HF_HUB_CACHE); an id not in the cache stops the launcher before anything starts."""

import os
import subprocess
import sys
import time

import pytest
import requests

from client.generate import stream_generate
from tests.hf_cache import write_hub_model, write_tiny_target


@pytest.fixture(scope="module")
def hub(tmp_path_factory, real_model_dir):
    """A Hugging Face cache holding ``acme/tiny-llama``: (cache folder, snapshot folder)."""
    root = tmp_path_factory.mktemp("hf")
    tiny = write_tiny_target(root / "src" / "tiny-llama", real_model_dir, seed=3)
    return root / "hub", write_hub_model(root / "hub", "acme/tiny-llama", tiny)


def _launch(tmp_path, cache, *args):
    from spec_decode.launcher import free_ports

    ports = [str(p) for p in free_ports(4)]
    env = dict(os.environ, HTTP_PORT=ports[0], GRPC_PORT=ports[1], METRICS_PORT=ports[2], OPENAI_PORT=ports[3],
               HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    log_path = tmp_path / "launcher.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "spec_decode.launcher", *args], env=env, stdout=log, stderr=log)
    return proc, ports, log_path, log


def test_a_hub_id_serves_with_one_flag(hub, tmp_path):
    """``--model acme/tiny-llama`` serves that model: greedy output through gRPC is its own greedy (transformers,
    in process), the OpenAI frontend names it ``tiny-llama``, the embedded target's draft LM and head are not
    offered beside it, and --max-model-len / --kv-cache-max-tokens / --dtype / --device reach the configs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, snapshot = hub
    proc, ports, log_path, log = _launch(tmp_path, cache, "--model", "acme/tiny-llama", "--dtype", "float32",
                                         "--device", "cpu", "--max-model-len", "256", "--kv-cache-max-tokens", "4096")
    try:
        deadline = time.time() + 600
        while time.time() < deadline and "All models READY" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(1)
        banner = log_path.read_text()
        assert "speculative_method: none, ngram, suffix, hybrid, auto" in banner, banner[-2000:]
        prompt = "def add(a, b):\n"
        out = stream_generate(f"127.0.0.1:{ports[1]}", prompt, 16, ignore_eos=True)
        tok = AutoTokenizer.from_pretrained(str(snapshot))
        model = AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32)
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.output_ids == ref
        models = requests.get(f"http://127.0.0.1:{ports[3]}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]][0] == "tiny-llama", models
        # max_model_len 256: a request past it is refused naming the limit
        too_long = requests.post(f"http://127.0.0.1:{ports[0]}/v2/models/generate/generate",
                                 json={"text_input": prompt, "max_tokens": 300}, timeout=30)
        assert too_long.status_code == 400 and "256" in too_long.text, too_long.text
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_an_id_not_in_the_cache_stops_the_launcher_naming_where_it_looked(hub, tmp_path):
    cache, _ = hub
    proc, _, log_path, log = _launch(tmp_path, cache, "--model", "acme/not-downloaded")
    try:
        assert proc.wait(120) == 2  # argparse's usage error, before tritonserver starts
    finally:
        log.close()
    text = log_path.read_text()
    assert "models--acme--not-downloaded" in text and "hf download acme/not-downloaded" in text, text[-2000:]
    assert "tritonserver" not in text.lower() or "All models READY" not in text
