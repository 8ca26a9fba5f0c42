"""The healer's logic without tritonserver: fake model processes (children of this test whose command lines look like
Triton's Python-backend stubs) and a fake server that records its repository calls."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spec_decode.launcher import DEFAULT_REPOSITORY, TritonServer
from spec_decode.launcher.healer import DiedWhileLoading, Healer, LoadWatch
from spec_decode.launcher.processes import stub_processes
from spec_decode.launcher.repository import decoupled_models, python_models

SLEEPER = "import time; time.sleep(120)"


def _fake_stub(repo: Path, model: str, instance: str) -> subprocess.Popen:
    """A child whose command line carries a model.py path under ``repo`` and an instance name, as the backend's;
    returned once that command line is in /proc (Triton's load returns once its stub runs: until the child has
    exec'd, /proc shows the parent's command line, and on a loaded machine the healer looked in between)."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, f"{repo}/{model}/1/model.py", "shm_region", instance])
    _wait_for(lambda: instance.encode() in _cmdline(proc.pid))
    return proc


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.02)


class _Proc:
    def __init__(self):
        import os

        self.pid = os.getpid()
        self.code = None

    def poll(self):
        return self.code


class FakeServer:
    """What the healer uses of TritonServer: ``proc``, ``repository``, ``generation``, repository calls, restart."""

    def __init__(self, repo: Path):
        self.repository = repo
        self.proc = _Proc()
        self.generation = 1
        self.calls: list[tuple[str, str]] = []
        self.stubs = {m: _fake_stub(repo, m, f"{m}_0_0") for m in ("generate", "verifier")}
        self.die_while_loading = False
        self.states: dict[str, str] = {}
        self.release_load = threading.Event()
        self.restarted = threading.Event()

    def repository_call(self, action, model=""):
        self.calls.append((action, model))
        if action == "index":
            return [{"name": m, "state": self.states.get(m, "READY")} for m in self.stubs]
        if action == "unload":
            self.states[model] = "UNAVAILABLE"
        if action == "load":
            self.states[model] = "LOADING" if self.die_while_loading else "READY"
            self.stubs[model] = _fake_stub(self.repository, model, f"{model}_0_0")
            if self.die_while_loading:  # the new process is killed before the load returns; Triton then hangs
                self.stubs[model].kill()
                self.stubs[model].wait()
                self.release_load.wait(30)
                raise ConnectionError("server killed")
        return []

    def load_unready_models(self):
        self.calls.append(("load_unready", ""))

    def restart(self, check=None):
        self.calls.append(("restart", ""))
        self.release_load.set()
        for p in self.stubs.values():
            p.kill()
            p.wait()
        self.stubs = {m: _fake_stub(self.repository, m, f"{m}_0_0") for m in self.stubs}
        self.generation += 1

    def restart_done(self):
        self.restarted.set()

    def close(self):
        for p in self.stubs.values():
            p.kill()
            p.wait()


@pytest.fixture
def fake(tmp_path):
    for model, extra in (("generate", "model_transaction_policy { decoupled: true }\n"), ("verifier", "")):
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(f'name: "{model}"\nbackend: "python"\n{extra}')
    (tmp_path / "spec_step").mkdir()
    (tmp_path / "spec_step" / "config.pbtxt").write_text('platform: "ensemble"\n# decoupled: true (a comment)\n')
    srv = FakeServer(tmp_path)
    _wait_for(lambda: len(stub_processes(srv.proc.pid, tmp_path)) == 2)
    yield srv
    srv.close()


def test_the_repository_s_decoupled_and_python_models():
    assert decoupled_models(DEFAULT_REPOSITORY) == {"generate", "generate_trtllm"}
    assert python_models(DEFAULT_REPOSITORY) == {"generate", "generate_trtllm", "draft_model", "target_model",
                                                 "verifier"}


def test_stub_processes_finds_model_processes_by_command_line(fake, tmp_path):
    found = {s.pid: s for s in stub_processes(fake.proc.pid, tmp_path)}
    assert {(s.model, s.instance, s.serves) for s in found.values()} == {
        ("generate", "generate_0_0", True), ("verifier", "verifier_0_0", True)}
    assert set(found) == {p.pid for p in fake.stubs.values()}
    other = subprocess.Popen([sys.executable, "-c", SLEEPER, "/elsewhere/verifier/1/model.py", "verifier_0_0"])
    auto = _fake_stub(tmp_path, "verifier", "verifier")  # the configuration-completing process of a load
    try:
        _wait_for(lambda: len(stub_processes(fake.proc.pid, tmp_path)) == 3)
        procs = stub_processes(fake.proc.pid, tmp_path)
        assert other.pid not in {s.pid for s in procs}
        assert [s.serves for s in procs if s.pid == auto.pid] == [False]
    finally:
        for p in (other, auto):
            p.kill()
            p.wait()


def test_a_dead_step_model_is_unloaded_and_loaded_again(fake, tmp_path):
    healer = Healer(fake, log=lambda m: None)
    healer._rebaseline()
    assert healer.check() == []
    old = fake.stubs["verifier"].pid
    fake.stubs["verifier"].kill()
    fake.stubs["verifier"].wait()
    assert healer.check() == ["verifier"]
    assert healer.busy() == {"verifier"}
    _wait_for(lambda: not healer.busy())
    calls = [c for c in fake.calls if c[0] != "index"]
    assert calls[:2] == [("unload", "verifier"), ("load", "verifier")] and ("load_unready", "") in calls
    assert [e.what for e in healer.events] == ["died", "reloading", "reloaded"]
    assert str(old) in healer.events[0].detail
    assert healer._expected["verifier"] == {fake.stubs["verifier"].pid}
    assert healer.check() == []  # the new process is the expected one


def test_a_look_that_overlaps_the_end_of_a_reload_does_not_report_the_old_process_again(fake, monkeypatch):
    """A look snapshots the expected processes, then reads /proc: when a reload ends between the two (it replaces the
    dead process with the new one and the model is no longer busy), the dead process must not count as a new death
    (it did: a second reload, whose unload killed the fresh process while the test watched)."""
    from spec_decode.launcher import healer as healing

    healer = Healer(fake, log=lambda m: None)
    healer._rebaseline()
    old = fake.stubs["verifier"].pid
    fake.stubs["verifier"].kill()
    fake.stubs["verifier"].wait()
    replacement = fake.stubs["generate"].pid  # a live process stands for the reloaded one
    real_alive = healing.process_alive

    def alive_as_the_reload_ends(pid, parent):
        with healer._lock:  # the reload finishes while this look reads /proc
            healer._expected["verifier"] = {replacement}
        return real_alive(pid, parent)

    monkeypatch.setattr(healing, "process_alive", alive_as_the_reload_ends)
    assert healer.check() == [] and healer.events == []
    monkeypatch.setattr(healing, "process_alive", real_alive)
    assert old not in healer._expected["verifier"] and healer.check() == []


def test_a_model_replaced_through_the_repository_api_is_not_taken_for_dead(fake):
    """TritonServer.reload: the old process ends once the new one is loaded; the healer holds off meanwhile and then
    expects the new one (before, it "healed" the replaced model: an unload and load that tore it down again)."""
    healer = Healer(fake, log=lambda m: None)
    healer._rebaseline()
    old = fake.stubs["verifier"]
    with healer.replacing("verifier"):
        fake.repository_call("load", "verifier")
        assert healer.check() == []
        # Triton ends the old process after the load returns: the healer waits for that before watching again
        threading.Timer(0.3, old.kill).start()
        with pytest.raises(RuntimeError, match="verifier is being reloaded or healed"):
            with healer.replacing("verifier"):
                pass
    assert old.poll() is not None and healer.events == [] and healer.busy() == set()
    assert healer._expected["verifier"] == {fake.stubs["verifier"].pid} != {old.pid}
    assert healer.check() == []
    # a load that fails leaves the old process serving, and expected
    serving = fake.stubs["verifier"]
    with pytest.raises(ConnectionError), healer.replacing("verifier"):
        raise ConnectionError("the load failed")
    assert healer._expected["verifier"] == {serving.pid} and healer.busy() == set()
    assert healer.check() == []
    fake.stubs["verifier"].kill()  # a death after the replacement is still seen
    fake.stubs["verifier"].wait()
    assert healer.check() == ["verifier"]
    _wait_for(lambda: not healer.busy())


def test_a_dead_decoupled_model_restarts_the_whole_server(fake):
    healer = Healer(fake, log=lambda m: None)
    healer._rebaseline()
    fake.stubs["generate"].kill()
    fake.stubs["generate"].wait()
    assert healer.check() == ["generate"]
    assert fake.restarted.wait(10)
    _wait_for(lambda: not healer.busy())
    assert ("restart", "") in fake.calls and ("load", "generate") not in fake.calls
    assert [e.what for e in healer.events] == ["died", "restarting", "restarted"]
    assert healer._expected == {m: {p.pid} for m, p in fake.stubs.items()}


def test_a_process_that_dies_while_loading_escalates_to_a_restart(fake):
    healer = Healer(fake, log=lambda m: None, load_grace_s=0.3, poll_s=0.05)
    healer._rebaseline()
    fake.die_while_loading = True
    fake.stubs["verifier"].kill()
    fake.stubs["verifier"].wait()
    assert healer.check() == ["verifier"]
    assert fake.restarted.wait(15)
    whats = [e.what for e in healer.events]
    assert whats[:3] == ["died", "reloading", "load_failed"] and whats[-1] == "restarted", healer.events
    assert "no process alive" in healer.events[2].detail or "died while loading" in healer.events[2].detail


def test_load_watch_names_a_process_that_vanished(fake, tmp_path):
    watch = LoadWatch(fake, "verifier", grace_s=60)
    watch.check()
    fake.stubs["verifier"].kill()
    fake.stubs["verifier"].wait()
    with pytest.raises(DiedWhileLoading, match="verifier_0_0 .process \\d+. died while loading"):
        watch.check()


def test_nothing_is_done_when_tritonserver_itself_died(fake):
    healer = Healer(fake, log=lambda m: None)
    healer._rebaseline()
    fake.proc.code = -9
    fake.stubs["verifier"].kill()
    fake.stubs["verifier"].wait()
    assert healer.check() == [] and fake.calls == [] and healer.events == []


def test_wait_returns_only_when_tritonserver_exits_by_itself():
    srv = TritonServer(heal=False)
    srv.proc = subprocess.Popen(["sleep", "30"])
    out = {}
    waiter = threading.Thread(target=lambda: out.setdefault("code", srv.wait()))
    waiter.start()
    # A restart by the healer: flag it, kill the process, start another.
    with srv._cond:
        srv._restarting = True
    srv.proc.kill()
    time.sleep(0.3)
    assert waiter.is_alive()
    srv.proc = subprocess.Popen(["sh", "-c", "sleep 0.5; exit 3"])
    srv.restart_done()
    waiter.join(10)
    assert out == {"code": 3}


def test_orphans_of_a_dead_tritonserver_are_found_by_the_pid_on_their_command_line(tmp_path):
    """The backend passes its own pid to each stub; after tritonserver dies its stubs are re-parented, and the
    launcher finds (and kills) them by that pid."""
    dead_server_pid = 4_000_000  # above pid_max: no such process
    stub = subprocess.Popen([sys.executable, "-c", SLEEPER, f"{tmp_path}/verifier/1/model.py", "shm_region",
                             str(dead_server_pid), "verifier_0_0"])
    try:
        _wait_for(lambda: stub_processes(dead_server_pid, tmp_path, orphans=True) != [])
        assert [(s.pid, s.instance) for s in stub_processes(dead_server_pid, tmp_path, orphans=True)] == [
            (stub.pid, "verifier_0_0")]
        assert stub_processes(dead_server_pid, tmp_path) == []
    finally:
        stub.kill()
        stub.wait()


def test_stop_during_a_restart_kills_at_once_and_no_restart_follows(tmp_path):
    """SIGTERM to the launcher while the healer restarts tritonserver: the loading server is killed at once (it is not
    serving), and the healer's restart does not start another."""
    srv = TritonServer(tmp_path, heal=False)
    srv.proc = subprocess.Popen(["sleep", "30"])
    with srv._cond:
        srv._restarting = True
    t0 = time.monotonic()
    srv.stop(timeout=40)
    assert time.monotonic() - t0 < 5 and srv.proc.poll() is not None
    with pytest.raises(RuntimeError, match="stopping"):
        srv.restart()


def test_stop_kills_the_model_processes_a_dead_tritonserver_left_behind(tmp_path):
    srv = TritonServer(tmp_path, heal=False)
    srv.proc = subprocess.Popen(["sleep", "30"])
    stub = subprocess.Popen([sys.executable, "-c", SLEEPER, f"{tmp_path}/target_model/1/model.py", "shm_region",
                             str(srv.proc.pid), "target_model_0_0"])
    try:
        _wait_for(lambda: stub_processes(srv.proc.pid, tmp_path, orphans=True) != [])
        srv.proc.kill()
        srv.proc.wait()  # tritonserver died by itself; its model process lives on
        srv.stop()
        assert stub.wait(5) == -9
    finally:
        stub.kill()
        stub.wait()


def test_the_shared_memory_region_of_a_dead_process_is_removed_after_its_reload(fake, tmp_path):
    import uuid

    region = f"triton_python_backend_shm_region_test-{uuid.uuid4()}"
    shm = Path("/dev/shm") / region
    shm.write_bytes(b"\0" * 16)
    try:
        fake.stubs["verifier"].kill()
        fake.stubs["verifier"].wait()
        fake.stubs["verifier"] = subprocess.Popen([sys.executable, "-c", SLEEPER, f"{tmp_path}/verifier/1/model.py",
                                                   region, "verifier_0_0"])
        _wait_for(lambda: any(s.shm_region == region for s in stub_processes(fake.proc.pid, tmp_path)))
        healer = Healer(fake, log=lambda m: None)
        healer._rebaseline()
        fake.stubs["verifier"].kill()
        fake.stubs["verifier"].wait()
        assert healer.check() == ["verifier"]
        _wait_for(lambda: not healer.busy())
        assert not shm.exists()
    finally:
        shm.unlink(missing_ok=True)
