"""Against a real tritonserver (fixture ``server``), through tritonclient as users do, on the real embedded model."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.generate import build_inputs, stream_generate
from spec_decode.proposers import METHODS

N_TOKENS = 64  # greedy_references (conftest.py) holds this many tokens per prompt
GREEDY_TOKENS = 48  # per method below (64 for auto: tests/integration/test_auto.py; every method in bfloat16 too)


def test_the_server_offers_every_registered_method(server):
    """The session's server has a draft LM, the trained EAGLE-3 head and a published head of every other layout
    (tests/conftest.py ``server``): every method is served, as the tests below assume."""
    from spec_decode.launcher import served_methods

    assert served_methods(server.repository) == ", ".join((*METHODS, "auto"))


@pytest.mark.parametrize("method", METHODS)  # every registered proposer (the session's server serves them all)
def test_greedy_output_equals_target_greedy(server, greedy_references, method):
    """The 5 prompts as 5 concurrent streams (lockstep rounds batch them into one forward per round): each output (48
    tokens) is the target's own greedy output. Every method solo, at k 1, 4 and 8: tests/integration/test_stops.py;
    every head solo: tests/integration/test_speculators.py."""
    with ThreadPoolExecutor(len(greedy_references)) as pool:
        runs = [pool.submit(stream_generate, server.grpc_url, prompt, GREEDY_TOKENS, speculative_method=method,
                            num_draft_tokens=4) for prompt, _ in greedy_references]
        results = [f.result(timeout=600) for f in runs]
    for (prompt, ref), r in zip(greedy_references, results):
        ref = ref[:GREEDY_TOKENS]
        assert r.output_ids == ref, (method, prompt[:60])
        assert r.stats["num_emitted_tokens"] == len(ref)
        if method == "none":
            # one step per token, plus the step that produced EOS (not emitted) when generation stopped there
            eos_step = r.stats["finish_reason"] == "stop"
            assert r.stats["num_draft_tokens_total"] == 0 and r.stats["num_steps"] == len(ref) + eos_step
        if method in ("eagle", "eagle3"):  # they draft from every step's hidden states: they crossed the ensembles
            assert r.stats["num_draft_tokens_total"] >= r.stats["num_steps"] - 1 > 0


def test_streaming_sends_multi_token_steps_that_concatenate(server, real_tokenizer, greedy_references):
    prompt, ref = greedy_references[0]
    r = stream_generate(server.grpc_url, prompt, N_TOKENS, speculative_method="draft", num_draft_tokens=4,
                        return_log_probs=True, draft_tree=False)  # the self-draft's chains (its trees branch)
    assert len(r.responses) > 3
    lps = r.stats["output_log_probs"]
    assert len(lps) == len(r.output_ids) and all(lp <= 0.0 for lp in lps)
    assert max(len(ids) for _, _, ids in r.responses) > 1
    assert "".join(t for _, t, _ in r.responses) == r.text == real_tokenizer.decode(ref, skip_special_tokens=True)
    # mean tokens per step above 1 with the self-draft (every draft accepted)
    assert r.stats["num_accepted_tokens"] == r.stats["num_draft_tokens_total"] > 0
    assert r.tokens_per_step > 1.5


def test_max_tokens_end_id_and_stop_word_inside_accepted_run(server, real_tokenizer, greedy_references):
    prompt, ref = greedy_references[1]
    # k=4 and every draft of the self-draft's chains accepted: steps emit 5 tokens; 7 ends inside the second step's run
    chains = {"draft_tree": False}
    r = stream_generate(server.grpc_url, prompt, 7, speculative_method="draft", num_draft_tokens=4, **chains)
    assert r.output_ids == ref[:7] and r.stats["finish_reason"] == "length"
    assert r.stats["num_emitted_tokens"] == 7

    pos = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i] and i % 5 not in (0, 4))
    r = stream_generate(server.grpc_url, prompt, N_TOKENS, speculative_method="draft", num_draft_tokens=4,
                        end_id=ref[pos], **chains)  # k=4 as above (not the server's default): pos inside a step's run
    assert r.output_ids == ref[:pos] and r.stats["finish_reason"] == "stop"
    assert r.stats["num_emitted_tokens"] == pos

    full = real_tokenizer.decode(ref, skip_special_tokens=True)
    # a 4-character stop string whose first occurrence starts after the 8th token, well before the end
    start = len(real_tokenizer.decode(ref[:8], skip_special_tokens=True))
    word = next(full[a : a + 4] for a in range(start, len(full) - 30) if full.index(full[a : a + 4]) == a)
    r = stream_generate(server.grpc_url, prompt, N_TOKENS, speculative_method="draft", num_draft_tokens=4,
                        stop_words=[word], **chains)
    assert r.text == full[: full.index(word)] and r.stats["finish_reason"] == "stop"
    assert word not in r.text and len(r.output_ids) < len(ref)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", {}, "text_input"),
        (b"\xff\xfe\xfd", {}, "text_input"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"max_tokens": -5}, "max_tokens"),
        ("hi", {"speculative_method": "magic"}, "speculative_method"),
        ("hi", {"num_draft_tokens": 1000}, "num_draft_tokens"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 2.0}, "top_p"),
        ("hi", {"end_id": 10**7}, "end_id"),
        ("hi", {"acceptance_method": "maybe"}, "acceptance_method"),
    ],
)
def test_bad_input_gets_error_naming_the_field_and_server_goes_on(server, prompt, params, field):
    max_tokens = params.pop("max_tokens", 4)
    with pytest.raises(InferenceServerException, match=field):
        stream_generate(server.grpc_url, prompt, max_tokens, **params)
    ok = stream_generate(server.grpc_url, "Hello", 3, speculative_method="ngram")
    assert len(ok.output_ids) == 3


def test_seeded_sampling_gives_same_text_twice(server):
    kw = dict(temperature=0.8, random_seed=1234, speculative_method="draft")
    a = stream_generate(server.grpc_url, "Once upon a time", 32, **kw)
    b = stream_generate(server.grpc_url, "Once upon a time", 32, **kw)
    c = stream_generate(server.grpc_url, "Once upon a time", 32, **{**kw, "random_seed": 99})
    assert a.text == b.text and a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
    # max_tokens only truncates: the steps (and so the seeded noise) do not depend on it
    short = stream_generate(server.grpc_url, "Once upon a time", 13, **kw)
    assert short.output_ids == a.output_ids[:13]
    kw["acceptance_method"] = "typical"
    t1 = stream_generate(server.grpc_url, "Once upon a time", 32, **kw)
    t2 = stream_generate(server.grpc_url, "Once upon a time", 32, **kw)
    assert t1.output_ids == t2.output_ids and t1.stats["num_accepted_tokens"] > 0


def test_typical_acceptance_at_temperature_zero_is_still_target_greedy(server, greedy_references):
    prompt, ref = greedy_references[3]
    r = stream_generate(server.grpc_url, prompt, N_TOKENS, speculative_method="ngram", acceptance_method="typical")
    assert r.output_ids == ref


def test_http_generate_and_generate_stream(server, greedy_references):
    prompt, ref = greedy_references[2]
    base = f"http://{server.http_url}/v2/models/generate"
    body = {"text_input": prompt, "max_tokens": 16, "exclude_input_in_output": True}  # stream defaults to false
    r = requests.post(f"{base}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == ref[:16]

    r = requests.post(f"{base}/generate_stream", json={**body, "stream": True, "speculative_method": "draft"},
                      stream=True, timeout=300)
    events = [json.loads(line[len(b"data: "):]) for line in r.iter_lines() if line.startswith(b"data: ")]
    # Triton's generate extension renders one-element tensors as JSON scalars.
    ids = [i for e in events for i in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]
    assert len(events) > 1 and ids == ref[:16]

    r = requests.post(f"{base}/generate", json={"text_input": "hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.text


def test_stream_false_sends_exactly_one_response(server, greedy_references):
    prompt, ref = greedy_references[4]
    r = stream_generate(server.grpc_url, prompt, 16, stream=False, exclude_input_in_output=True)
    assert len(r.responses) == 1 and r.output_ids == ref[:16]
    r = stream_generate(server.grpc_url, prompt, 16, stream=False)  # exclude_input_in_output defaults to false
    assert r.text.startswith(prompt) and r.output_ids == ref[:16]


def test_internal_step_model_validates_direct_calls(server):
    """spec_step is reachable on the same ports: its models check k, token ids and sampling parameters too, and its
    results say what the target measured (num_cached_tokens, target_forward_seconds) and spend a prompt's share of the
    round's budget (num_scheduled_tokens)."""
    import numpy as np

    def step(k=4, ids=(1, 2, 3), temperature=0.0, release=False, share=None, seq=1):
        values = {"sequence_id": ("UINT64", np.array([seq], np.uint64)),
                  "token_ids": ("INT64", np.array(ids, np.int64)),
                  "num_draft_tokens": ("INT32", np.array([k], np.int32)),
                  "speculative_method": ("BYTES", np.array([b"draft"], object)),
                  "temperature": ("FP32", np.array([temperature], np.float32)),
                  "top_k": ("INT32", np.array([0], np.int32)), "top_p": ("FP32", np.array([1.0], np.float32)),
                  "random_seed": ("INT64", np.array([0], np.int64)), "seeded": ("BOOL", np.array([True])),
                  "step": ("INT64", np.array([0], np.int64)),
                  "release": ("BOOL", np.array([release])), "acceptance_method": ("BYTES", np.array([b""], object))}
        if share is not None:
            values["num_scheduled_tokens"] = ("INT32", np.array([share], np.int32))
        inputs = []
        for name, (dt, arr) in values.items():
            arr = arr[None]  # batch dimension: one sequence per request
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        with grpcclient.InferenceServerClient(server.grpc_url) as c:
            return c.infer("spec_step", inputs)

    first = step()
    assert first.as_numpy("output_ids").size == 5  # the self-draft accepts all 4 drafts
    assert first.as_numpy("num_cached_tokens")[0, 0] == 0 and first.as_numpy("target_forward_seconds")[0, 0] > 0
    # a prompt past its share (num_scheduled_tokens) without drafts: the target prefills a chunk and scores nothing;
    # the next share goes on from what it reused
    prompt = tuple(range(1, 101))
    chunk = step(k=0, ids=prompt, share=40, seq=2)
    assert chunk.as_numpy("output_ids").size == 0 and chunk.as_numpy("num_cached_tokens")[0, 0] == 0
    rest = step(k=0, ids=prompt, share=80, seq=2)
    assert rest.as_numpy("output_ids").size == 1 and rest.as_numpy("num_cached_tokens")[0, 0] == 40
    for kwargs, field in (({"k": 1000}, "num_draft_tokens"), ({"ids": (1, 10**9)}, "token ids"),
                          ({"temperature": -1.0}, "temperature"), ({"share": -5}, "num_scheduled_tokens")):
        with pytest.raises(InferenceServerException, match=field):
            step(**kwargs)
    step(release=True, seq=2)
    step(release=True)  # a direct caller frees its sequence's caches (other tests check that every cache is empty)


def test_cancelled_stream_leaves_server_serving(server):
    """Cancel a long stream after its first response; the server keeps serving the next request."""
    import queue

    q = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("generate", build_inputs("Write a long story.", 512, speculative_method="none",
                                                       stream=True))
    res, err = q.get(timeout=120)
    assert err is None
    client.stop_stream(cancel_requests=True)
    client.close()
    ok = stream_generate(server.grpc_url, "Hello", 3)
    assert len(ok.output_ids) == 3


def test_disable_by_batch_size_turns_speculation_off(tmp_path, greedy_references, server):
    """A server with disable_by_batch_size=1: every running request reaches the threshold, so no step drafts; and a
    seeded sampled request gives there the tokens it gives on the default server (fixture ``server``) with every method
    at k = 4 (the model proposers at 1 too), four streams at a time, and beside three other streams: the coupled race
    (docs/verifier.md) makes a seeded request's output independent of the drafts, k and the load."""
    from spec_decode.launcher import TritonServer, prepare_repository

    repo = prepare_repository({"generate": {"disable_by_batch_size": "1"}})
    with TritonServer(repo, log_path=tmp_path / "server.log") as srv:
        srv.wait_ready(timeout=600)
        prompt, ref = greedy_references[0]
        r = stream_generate(srv.grpc_url, prompt, 16, speculative_method="ngram", num_draft_tokens=4)
        assert r.output_ids == ref[:16]
        assert r.stats["num_draft_tokens_total"] == 0 and r.stats["num_steps"] == 16
        seeded = dict(temperature=0.8, random_seed=24)
        alone = stream_generate(srv.grpc_url, prompt, 32, speculative_method="suffix", **seeded)
        assert alone.stats["num_draft_tokens_total"] == 0 and len(alone.output_ids) >= 8
    # every method at k 4 and the model proposers also at k 1 (one draft: a chain), four streams at a time (each
    # beside three others of different drafts)
    cases = [(method, 4) for method in METHODS] + [(m, 1) for m in ("draft", "eagle3", "medusa", "mlp_speculator")]
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(stream_generate, server.grpc_url, prompt, 32, speculative_method=method,
                            num_draft_tokens=k, **seeded) for method, k in cases]
        for (method, k), f in zip(cases, runs):
            assert f.result(timeout=600).output_ids == alone.output_ids, (method, k)
    with ThreadPoolExecutor(4) as pool:  # under load: three other streams in the same rounds
        others = [pool.submit(stream_generate, server.grpc_url, p, 48, speculative_method="ngram", ignore_eos=True)
                  for p, _ in greedy_references[1:4]]
        loaded = stream_generate(server.grpc_url, prompt, 32, speculative_method="hybrid", num_draft_tokens=4, **seeded)
        for f in others:
            f.result(timeout=600)
    assert loaded.output_ids == alone.output_ids


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to a launcher started with SIGINT ignored"])
def test_launcher_sigterm_stops_tritonserver(tmp_path, how):
    """`kill <launcher>` (systemd, supervisors) must not orphan tritonserver and its backend stubs; nor `kill -INT`
    of a launcher started in the background of a script (which inherits SIGINT ignored): it stops everything rather
    than leave tritonserver to stop alone and the healer to restart it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from spec_decode.launcher import free_ports

    ports = [str(p) for p in free_ports(4)]
    env = dict(os.environ, HTTP_PORT=ports[0], GRPC_PORT=ports[1], METRICS_PORT=ports[2], OPENAI_PORT=ports[3])
    log = open(tmp_path / "launcher.log", "w")
    sig = signal.SIGTERM if how == "SIGTERM" else signal.SIGINT
    ignore = None if how == "SIGTERM" else (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    launcher = subprocess.Popen([sys.executable, "-m", "spec_decode.launcher"], env=env, stdout=log, stderr=log,
                                preexec_fn=ignore)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and "All models READY" not in (tmp_path / "launcher.log").read_text():
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(1)
        assert requests.get(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=5).status_code == 200
        launcher.send_signal(sig)
        launcher.wait(60)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                requests.get(f"http://127.0.0.1:{ports[0]}/v2/health/live", timeout=2)
            except requests.ConnectionError:
                break
            time.sleep(1)
        else:
            pytest.fail(f"tritonserver still answers after the launcher got {how}")
        stray = subprocess.run(["pgrep", "-f", "--", f"--http-port={ports[0]}"], capture_output=True, text=True).stdout
        assert stray.strip() == ""
        frontend = subprocess.run(["pgrep", "-f", "--", f"spec_decode.openai_api .*--port {ports[3]}"],
                                  capture_output=True, text=True).stdout
        assert frontend.strip() == ""  # the OpenAI frontend went with it
    finally:
        if launcher.poll() is None:
            launcher.kill()
        subprocess.run(["pkill", "-f", "--", f"--http-port={ports[0]}"])
        subprocess.run(["pkill", "-f", "--", f"spec_decode.openai_api .*--port {ports[3]}"])
        log.close()


@pytest.mark.parametrize("overrides, named", [
    ({"verifier": {"acceptance_method": "maybe"}}, "config parameter 'acceptance_method': 'maybe' is not one of"),
    ({"generate": {"max_num_draft_tokens": "32"}}, "config parameter 'max_num_draft_tokens': 32 is above"),
])
def test_a_bad_config_stops_the_launcher_naming_the_parameter(tmp_path, overrides, named):
    """A config value out of range fails its model's load: the launcher exits 1 at once, tritonserver's log names the
    parameter, and the launcher's last line says where to look."""
    import os
    import subprocess
    import sys

    from spec_decode.launcher import free_ports, prepare_repository

    repo = prepare_repository(overrides)
    ports = [str(p) for p in free_ports(4)]
    env = dict(os.environ, HTTP_PORT=ports[0], GRPC_PORT=ports[1], METRICS_PORT=ports[2], OPENAI_PORT=ports[3])
    try:
        done = subprocess.run([sys.executable, "-m", "spec_decode.launcher", "--model-repository", str(repo)], env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["pkill", "-f", "--", f"--http-port={ports[0]}"])
    assert done.returncode == 1, done.stderr[-2000:]
    assert named in done.stdout + done.stderr
    assert "spec_decode.launcher: tritonserver exited" in done.stderr.splitlines()[-1]


def test_launcher_exits_non_zero_and_says_why_when_tritonserver_dies(tmp_path):
    """kill -9 of tritonserver itself: the launcher must not look healthy; it exits non-zero (so a supervisor restarts
    it) and names the cause."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from spec_decode.launcher import free_ports

    ports = [str(p) for p in free_ports(4)]
    env = dict(os.environ, HTTP_PORT=ports[0], GRPC_PORT=ports[1], METRICS_PORT=ports[2], OPENAI_PORT=ports[3])
    env.pop("DTYPE", None)  # the launcher then serves the repository itself, whose stubs are looked for below
    log_path = tmp_path / "launcher.log"
    log = open(log_path, "w")
    launcher = subprocess.Popen([sys.executable, "-m", "spec_decode.launcher"], env=env, stdout=log, stderr=log)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and "All models READY" not in log_path.read_text():
            assert launcher.poll() is None, log_path.read_text()[-3000:]
            time.sleep(1)
        server_pid = subprocess.run(["pgrep", "-f", "--", f"--http-port={ports[0]}"], capture_output=True,
                                    text=True).stdout.split()
        assert len(server_pid) == 1, server_pid
        from spec_decode.launcher import DEFAULT_REPOSITORY
        from spec_decode.launcher.processes import stub_processes

        stubs = stub_processes(int(server_pid[0]), DEFAULT_REPOSITORY)
        assert len(stubs) == 5, stubs  # generate, generate_trtllm, draft_model, target_model, verifier
        # streams in flight: a target_model process then outlives tritonserver unless the launcher kills it
        import threading

        from client.generate import stream_generate

        started = threading.Event()

        def stream():
            try:
                stream_generate(f"127.0.0.1:{ports[1]}", "def f(x):\n", 300, ignore_eos=True, timeout_s=60,
                                on_text=lambda _t: started.set())
            except Exception:  # noqa: BLE001 - the connection closes: expected
                pass

        streams = [threading.Thread(target=stream, daemon=True) for _ in range(2)]
        for t in streams:
            t.start()
        assert started.wait(60)
        os.kill(int(server_pid[0]), signal.SIGKILL)
        status = launcher.wait(30)
        assert status == 128 + signal.SIGKILL
        assert "tritonserver killed by SIGKILL while serving" in log_path.read_text()
        # and no model process is left behind (they would hold their memory, re-parented, for good)
        time.sleep(0.5)
        assert stub_processes(int(server_pid[0]), DEFAULT_REPOSITORY, orphans=True) == []
        frontend = subprocess.run(["pgrep", "-f", "--", f"spec_decode.openai_api .*--port {ports[3]}"],
                                  capture_output=True, text=True).stdout
        assert frontend.strip() == ""
    finally:
        if launcher.poll() is None:
            launcher.kill()
        subprocess.run(["pkill", "-9", "-f", "--", f"--http-port={ports[0]}"])
        subprocess.run(["pkill", "-9", "-f", "--", f"spec_decode.openai_api .*--port {ports[3]}"])
        log.close()
