"""Faults against a real tritonserver: ``kill -9`` of each model's process during 4 concurrent streams.

The server is started by :class:`spec_decode.launcher.TritonServer`, which heals
(``spec_decode.launcher.healer``): a dead step
model is unloaded and loaded again, a dead ``generate`` restarts the whole server. Every stream in flight must end
within 10 s, readiness must go not-ready and come back, a request after recovery must equal the target's own greedy
output, and the running-sequences gauge must return to 0.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from client.generate import stream_generate
from client.metrics import value, wait_for
from spec_decode.launcher import MODELS, TritonServer, prepare_repository
from spec_decode.launcher.processes import stub_processes

STREAM_TOKENS = 400  # long enough to be in flight for the whole test of one kill
RUNNING = "spec_decode_running_sequences"
CACHES = (RUNNING, "spec_decode_target_kv_cache_sequences", "spec_decode_draft_kv_cache_sequences",
          "spec_decode_eagle_cache_sequences", "spec_decode_eagle3_cache_sequences",
          "spec_decode_suffix_active_requests")


@pytest.fixture(scope="module")
def healing_server(tmp_path_factory, running_server):
    """A tritonserver of its own (kills must not disturb the session's server), healed, the default repository (in
    the suite's DTYPE: prepare_repository)."""
    yield from running_server(prepare_repository(), tmp_path_factory.mktemp("faults") / "server.log")


def _pid(srv: TritonServer, model: str) -> int:
    return next(s.pid for s in stub_processes(srv.proc.pid, srv.repository) if s.model == model and s.serves)


def _ready(srv: TritonServer, model: str) -> tuple:
    """(server ready, model ready) as HTTP status codes, or 'down' when the port does not answer."""
    out = []
    for path in ("/v2/health/ready", f"/v2/models/{model}/ready"):
        try:
            out.append(requests.get(f"http://{srv.http_url}{path}", timeout=2).status_code)
        except requests.RequestException:
            out.append("down")
    return tuple(out)


def _all_ready(srv: TritonServer) -> bool:
    client = httpclient.InferenceServerClient(srv.http_url)
    try:
        return client.is_server_ready() and all(client.is_model_ready(m) for m in MODELS)
    except Exception:  # noqa: BLE001 - down while restarting
        return False
    finally:
        client.close()


class _Streams:
    """``n`` concurrent streams of the default method, seeded sampling (greedy rounds skip the verifier: sampled ones
    pass through every step model, so each kill reaches them); records how and when each ended."""

    def __init__(self, srv: TritonServer, n: int = 4):
        self.started = [threading.Event() for _ in range(n)]
        self.ended: dict[int, tuple[str, str, float]] = {}
        self.threads = [threading.Thread(target=self._run, args=(srv.grpc_url, i), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int) -> None:
        try:
            r = stream_generate(url, f"def function_{i}(values):\n", STREAM_TOKENS, ignore_eos=True, timeout_s=120,
                                temperature=0.8, random_seed=i + 1, on_text=lambda _t: self.started[i].set())
            self.ended[i] = ("complete", str(len(r.output_ids)), time.monotonic())
        except Exception as e:  # noqa: BLE001 - what the client sees is the point
            self.ended[i] = ("error", str(e), time.monotonic())
        finally:
            self.started[i].set()

    def wait_started(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for ev in self.started:
            assert ev.wait(max(0.0, deadline - time.monotonic())), "a stream produced nothing"
        assert not self.ended, f"a stream ended before the kill: {self.ended}"

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _watch_recovery(srv: TritonServer, model: str, timeout: float = 120.0) -> list:
    """Poll readiness every 50 ms until it has been not-ready and every model is ready again; returns the changes."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _ready(srv, model)
        if not seen or seen[-1][1] != state:
            seen.append((time.monotonic(), state))
        if len(seen) > 1 and state == (200, 200) and _all_ready(srv) and not srv.healer.busy():
            return seen
        time.sleep(0.05)
    raise AssertionError(f"not recovered within {timeout} s: {seen}")


def _check_after_recovery(srv: TritonServer, greedy_references, i: int) -> None:
    prompt, ref = greedy_references[i % len(greedy_references)]
    out = stream_generate(srv.grpc_url, prompt, len(ref), timeout_s=120)
    assert out.output_ids == ref, "greedy output after recovery differs from the target's own"
    # The running gauge returns to 0, and so do the caches of the models that survived: the releases that failed
    # while a model reloaded went again with this request's release.
    samples = wait_for(srv.metrics_url, lambda s: (RUNNING, ()) in s and all(value(s, g) == 0 for g in CACHES),
                       timeout_s=10)
    assert value(samples, RUNNING) == 0


@pytest.mark.parametrize("victim", ["verifier", "draft_model", "target_model", "generate"])
def test_kill_9_of_a_model_process_during_4_streams_heals(healing_server, greedy_references, victim):
    srv = healing_server
    assert _all_ready(srv)
    streams = _Streams(srv)
    streams.wait_started()
    wait_for(srv.metrics_url, lambda s: value(s, RUNNING) == 4, timeout_s=10)
    n_events = len(srv.healer.events)

    killed_at = time.monotonic()
    os.kill(_pid(srv, victim), signal.SIGKILL)
    seen = _watch_recovery(srv, victim)
    streams.join(max(0.0, killed_at + 10 - time.monotonic()))

    # Every stream ended within 10 s, with an error that says what failed (or completed).
    assert len(streams.ended) == 4, f"streams still open 10 s after the kill: {set(range(4)) - set(streams.ended)}"
    for i, (how, detail, t) in streams.ended.items():
        assert t - killed_at <= 10, f"stream {i} ended {t - killed_at:.1f} s after the kill"
        if how == "error" and victim == "generate":
            assert "UNAVAILABLE" in detail  # the whole server restarted: the connection closed
        elif how == "error":  # "Stub process '<victim>_0_0' is not healthy", or "[not ready: <victim>; ...]"
            assert f"'{victim}_0_0' is not healthy" in detail or f"not ready: {victim}" in detail, detail
        else:
            assert int(detail) == STREAM_TOKENS

    # Readiness went not-ready (server and the model; a restart is a closed port) and came back.
    states = [s for _, s in seen]
    assert any(s[0] != 200 and s[1] != 200 for s in states), states
    assert states[-1] == (200, 200)
    events = srv.healer.events[n_events:]
    died = next(e for e in events if e.what == "died")
    assert died.model == victim and died.t - killed_at < 1.5, events
    assert events[-1].what == ("restarted" if victim == "generate" else "reloaded"), events

    _check_after_recovery(srv, greedy_references, ["verifier", "draft_model", "target_model", "generate"].index(victim))


def test_a_second_kill_during_recovery_recovers_too(healing_server, greedy_references):
    srv = healing_server
    assert _all_ready(srv)
    first = _pid(srv, "target_model")
    n_events = len(srv.healer.events)
    os.kill(first, signal.SIGKILL)
    # The replacement instance process appears while the model loads again: kill it too, half a second into its
    # load (an out-of-memory kill comes once a process has allocated).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = [s.pid for s in stub_processes(srv.proc.pid, srv.repository) if s.model == "target_model" and s.serves]
        if pids and pids[0] != first:
            time.sleep(0.5)
            os.kill(pids[0], signal.SIGKILL)
            break
        time.sleep(0.02)
    else:
        pytest.fail("no replacement target_model process appeared")
    _watch_recovery(srv, "target_model")
    whats = [e.what for e in srv.healer.events[n_events:]]
    assert "load_failed" in whats and whats[-1] in ("reloaded", "restarted"), whats
    _check_after_recovery(srv, greedy_references, 4)


def test_clients_cannot_load_or_unload_models(healing_server):
    srv = healing_server
    h = httpclient.InferenceServerClient(srv.http_url)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        for call in (lambda: h.unload_model("verifier"), lambda: g.unload_model("verifier"),
                     lambda: h.load_model("verifier"), lambda: g.get_model_repository_index()):
            with pytest.raises(InferenceServerException, match="restricted|expecting header"):
                call()
        assert h.is_model_ready("verifier") and h.is_server_ready()
    finally:
        h.close()
        g.close()
