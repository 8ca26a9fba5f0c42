"""The healer: watch a running tritonserver's model processes and bring back one that dies.

Triton 2.51's Python backend does not restart a model process (``triton_python_backend_stub``) that dies (an
out-of-memory kill, a crash in a native library): from then on every request to that model fails with "Stub process
'<instance>' is not healthy" while ``/v2/health/ready`` and the model's ready endpoint still answer 200 (upstream
triton-inference-server/server issues #7862 and #8604). :class:`Healer` watches the model processes of a server
(:class:`HealedServer`: what it needs of :class:`~spec_decode.launcher.server.TritonServer`) and, within about one
poll interval of a death:

- a model whose requests are not decoupled (the step models) is unloaded and loaded again through Triton's model
  repository API; the other models go on serving, and Triton reports the server and that model not ready until the
  load returns. Requests waiting on the dead process fail with the backend's "not healthy" error, so every
  ``generate`` stream stepping through it ends with an error response; caches rebuild on demand in the fresh process
  (each step carries what a cache miss needs).
- a decoupled model (``generate`` and ``generate_trtllm``, the client entry points) is different: its in-flight
  requests belonged to the dead process and Triton never ends them, not after an unload and reload of the model
  either, and tritonserver then ignores SIGINT because those requests never finish. So the whole server is restarted
  on the same ports (SIGKILL, start, wait until every model is ready), which closes every client connection: their
  streams end at once with a transport error (gRPC ``UNAVAILABLE``) instead of waiting forever.

A new process that dies while its model loads (a second fault during recovery) leaves Triton's load waiting forever,
so :class:`LoadWatch` looks for that and the healer restarts the whole server; a load that fails otherwise is retried,
and after ``max_attempts`` failures the whole server is restarted too. After 3 failed restarts the healer gives up and
the launcher exits non-zero. docs/deployment.md describes faults and healing as an operator sees them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .events import Event, stderr_line
from .processes import process_alive, remove_shm_regions, stub_processes
from .repository import decoupled_models, python_models

T = TypeVar("T")


class ServerProcess(Protocol):
    """The running tritonserver process, as the healer sees it (a :class:`subprocess.Popen`)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


class HealedServer(Protocol):
    """What the healer needs from the server it heals (:class:`~spec_decode.launcher.server.TritonServer` is one)."""

    @property
    def proc(self) -> ServerProcess | None:
        """The current tritonserver process (replaced by each restart; set once the server has started)."""
        ...

    @property
    def repository(self) -> Path:
        """The model repository it serves."""
        ...

    @property
    def generation(self) -> int:
        """Starts so far: a restart makes a new generation."""
        ...

    def repository_call(self, action: str, model: str = "") -> list[dict]:
        """Triton's model repository API: ``load``, ``unload`` (blocking) or ``index``."""
        ...

    def load_unready_models(self) -> None:
        """Load every model that is not READY."""
        ...

    def restart(self, *, check: Callable[[], None] | None = None) -> None:
        """Kill tritonserver and its model processes, start it again, and wait until every model is ready, calling
        ``check`` at every look; raises when the new server does not get ready."""
        ...

    def restart_done(self) -> None:
        """End a :meth:`restart`, successful or not."""
        ...


def _started(server: HealedServer) -> ServerProcess:
    proc = server.proc
    assert proc is not None, "the healer watches a started server"  # TritonServer.proc is never None after start()
    return proc


class DiedWhileLoading(RuntimeError):
    """A model's process died while Triton was loading the model."""


class LoadWatch:
    """Watch a server while models load, for a model process that dies before its load returns: Triton 2.51's Python
    backend then waits for the dead process forever, so that load would never return.

    A model is taken to have died while loading when a process of it seen by an earlier look is gone, or, for a process
    killed between two looks, when Triton has reported the model ``LOADING`` (repository index) for over ``grace_s``
    with none of its processes alive. The backend starts a model's processes as its load begins, but a load may also
    wait, with no process, for the same model's earlier instance to finish unloading while requests to the dead
    process time out, so ``grace_s`` is generous.

    Args:
        server: the server; the tritonserver process running at the first :meth:`check` is the one watched.
        model: watch only this model (None: every Python-backend model of the repository).
        grace_s: seconds a model may be LOADING with no process of its own.
    """

    def __init__(self, server: HealedServer, model: str | None = None, grace_s: float = 20.0):
        self.server = server
        self.models = {model} if model else python_models(server.repository)
        self.grace_s = grace_s
        self.pid: int | None = None
        self.seen: dict[int, str] = {}
        self.loading_since: dict[str, float] = {}

    def check(self) -> None:
        """Look once.

        Raises:
            DiedWhileLoading: a watched model's process died while it loads (the message names it).
        """
        if self.pid is None:
            self.pid = _started(self.server).pid
        stubs = [s for s in stub_processes(self.pid, self.server.repository) if s.model in self.models]
        live = {s.pid: s.instance for s in stubs if s.serves}
        gone = sorted(set(self.seen) - set(live))
        if gone:
            raise DiedWhileLoading(", ".join(f"{self.seen[p]} (process {p})" for p in gone) + " died while loading")
        self.seen.update(live)
        try:
            states = {m["name"]: m.get("state") for m in self.server.repository_call("index")}
        except Exception:  # noqa: BLE001 - the server is not answering yet
            return
        now, alive = time.monotonic(), {s.model for s in stubs}
        for model in self.models:
            if states.get(model) != "LOADING":
                self.loading_since.pop(model, None)
                continue
            since = self.loading_since.setdefault(model, now)
            if model not in alive and now - since > self.grace_s:
                raise DiedWhileLoading(f"{model} has been loading for {now - since:.1f} s with no process alive")

    def run(self, fn: Callable[[], T], poll_s: float) -> T:
        """Call ``fn()`` (a blocking load) in a thread, looking every ``poll_s`` seconds while it runs.

        Returns:
            What ``fn`` returned.

        Raises:
            DiedWhileLoading: as :meth:`check` (``fn`` is left to fail when the server is killed).
            Exception: whatever ``fn`` raised.
        """
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result["error"] = e

        t = threading.Thread(target=call, daemon=True, name="spec-decode-load")
        t.start()
        while t.is_alive():
            self.check()
            t.join(poll_s)
        if "error" in result:
            raise result["error"]
        return result["value"]


class Healer:
    """Watch a server's model processes and bring dead ones back (module docstring).

    The healer runs in a daemon thread between :meth:`start` and :meth:`stop`. It never acts when tritonserver itself
    has exited: that is the launcher's business (it exits non-zero so that a supervisor restarts it).

    Args:
        server: a started server whose models are all ready (the healer takes the live stubs as the expected set).
        poll_s: seconds between two looks at the expected processes; a death is acted on within about this long
            (during a load, every ``min(poll_s, 0.1)`` seconds).
        max_attempts: loads of one model to try before restarting the whole server instead.
        log: called with each event's message (default: a line on stderr).
        load_grace_s: :class:`LoadWatch`'s ``grace_s``.
    """

    def __init__(self, server: HealedServer, poll_s: float = 0.25, max_attempts: int = 5,
                 log: Callable[[str], object] | None = None, load_grace_s: float = 20.0):
        self.server = server
        self.poll_s = poll_s
        self.max_attempts = max_attempts
        self.load_grace_s = load_grace_s
        self.events: list[Event] = []
        self._log = log or stderr_line
        self._restart_on_death = decoupled_models(server.repository)
        self._lock = threading.Lock()
        self._expected: dict[str, set[int]] = {}
        self._busy: set[str] = set()  # models being reloaded ("tritonserver": a restart in progress)
        self._regions: dict[int, str] = {}  # expected process -> its /dev/shm region
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> Healer:
        """Take the server's live model processes as the expected set and start watching."""
        self._rebaseline()
        self._thread = threading.Thread(target=self._run, name="spec-decode-healer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching, waiting up to ``timeout`` seconds for the watcher thread (a reload or restart in progress
        finishes in its own thread, or is abandoned at exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @contextmanager
    def replacing(self, model: str, timeout_s: float = 60.0) -> Iterator[None]:
        """Hold off watching ``model`` while the caller replaces its processes through the repository API (a load with
        another configuration), then take its serving processes as the expected ones: after a load that returned,
        the new ones (Triton ends the old ones after the load returns: this waits up to ``timeout_s`` seconds for
        that), after a load that raised, the old ones, which serve on.

        Raises:
            RuntimeError: the healer is reloading ``model``, or restarting the server, right now.
        """
        with self._lock:
            if model in self._busy or "tritonserver" in self._busy:
                raise RuntimeError(f"{model} is being reloaded or healed right now; try again once the server is ready")
            self._busy.add(model)
            old = set(self._expected.get(model, set()))
        loaded = False
        try:
            yield
            loaded = True
        finally:
            server_pid = _started(self.server).pid
            deadline = time.monotonic() + timeout_s
            while loaded and any(process_alive(p, server_pid) for p in old) and time.monotonic() < deadline:
                time.sleep(0.05)
            stubs = [s for s in stub_processes(server_pid, self.server.repository)
                     if s.model == model and s.serves and not (loaded and s.pid in old)]
            with self._lock:
                gone = old - {s.pid for s in stubs}
                self._expected[model] = {s.pid for s in stubs}
                self._busy.discard(model)
            self._regions.update({s.pid: s.shm_region for s in stubs})
            remove_shm_regions([self._regions.pop(pid, "") for pid in gone])

    def busy(self) -> set[str]:
        """Models being reloaded right now (``tritonserver`` while the whole server restarts)."""
        with self._lock:
            return set(self._busy)

    # -- watching ----------------------------------------------------------------------------------------------------

    def _event(self, model: str, what: str, detail: str) -> None:
        self.events.append(Event(time.monotonic(), model, what, detail))
        self._log(f"{model}: {what}: {detail}")

    def _rebaseline(self) -> None:
        live: dict[str, set[int]] = {}
        for s in stub_processes(_started(self.server).pid, self.server.repository):
            if s.serves:
                live.setdefault(s.model, set()).add(s.pid)
                self._regions[s.pid] = s.shm_region
        with self._lock:
            self._expected = live

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watcher must outlive any one bad look
                self._log(f"watcher error (ignored): {e!r}")

    def check(self) -> list[str]:
        """Look once at every expected process and act on every model whose expected process is gone.

        Returns:
            The models acted on.
        """
        proc = _started(self.server)
        with self._lock:
            if "tritonserver" in self._busy:
                return []
            expected = {m: set(pids) for m, pids in self._expected.items()}
        gone_by_model = {m: {p for p in pids if not process_alive(p, proc.pid)} for m, pids in expected.items()}
        if proc.poll() is not None:
            return []  # tritonserver itself died: its stubs look gone too, but that is the launcher's to report
        acted = []
        with self._lock:
            for model, gone in gone_by_model.items():
                gone &= self._expected.get(model, set())  # a reload that ended since the snapshot replaced them
                if not gone or model in self._busy:
                    continue
                acted.append(model)
                self._busy.add(model)
                restart = model in self._restart_on_death
                if restart:
                    self._busy.add("tritonserver")
                self._event(model, "died", f"process {', '.join(map(str, sorted(gone)))} is gone")
                target = self._restart if restart else self._reload
                regions = [self._regions.pop(pid, "") for pid in gone]
                threading.Thread(target=target, args=(model, self.server.generation, regions), daemon=True,
                                 name=f"spec-decode-heal-{model}").start()
                if restart:
                    break
        return acted

    # -- recovery ----------------------------------------------------------------------------------------------------

    def _reload(self, model: str, generation: int, regions: list[str]) -> None:
        t0 = time.monotonic()
        expected = len(self._expected.get(model, ())) or 1
        self._event(model, "reloading", "unload and load through the repository API; server not ready meanwhile")
        for attempt in range(1, self.max_attempts + 1):
            if self._stop.is_set() or self.server.generation != generation:
                return self._done(model)
            try:
                self.server.repository_call("unload", model)
            except Exception:  # noqa: BLE001 - already unloaded (an earlier attempt) is fine
                pass
            watch = LoadWatch(self.server, model, self.load_grace_s)
            try:
                watch.run(lambda: self.server.repository_call("load", model), min(self.poll_s, 0.1))
                stubs = [s for s in stub_processes(_started(self.server).pid, self.server.repository)
                         if s.model == model and s.serves]
                pids = {s.pid for s in stubs}
                if len(pids) < expected:
                    raise RuntimeError(f"{len(pids)} of {expected} processes alive after the load")
                self.server.load_unready_models()
            except DiedWhileLoading as e:
                # Triton's load never returns when the new process dies while loading, and holds the model
                # meanwhile: only a restart of the whole server gets out of that.
                self._event(model, "load_failed", f"attempt {attempt}: {e}")
                break
            except Exception as e:  # noqa: BLE001 - a process killed just after loading, a load error: try again
                self._event(model, "load_failed", f"attempt {attempt}: {e}")
                time.sleep(1.0)
                continue
            with self._lock:
                self._expected[model] = pids
                self._busy.discard(model)
            self._regions.update({x.pid: x.shm_region for x in stubs})
            remove_shm_regions(regions)
            self._event(model, "reloaded", f"in {time.monotonic() - t0:.1f} s (process {', '.join(map(str, pids))})")
            return
        with self._lock:
            if "tritonserver" in self._busy:
                return self._done(model)
            self._busy.add("tritonserver")
        self._restart(model, generation, regions)

    def _restart(self, model: str, generation: int, regions: list[str]) -> None:
        t0 = time.monotonic()
        try:
            for attempt in range(1, 4):
                if self._stop.is_set():
                    return
                self._event("tritonserver", "restarting", f"because of {model} (attempt {attempt}): every client "
                            f"connection closes, so streams in flight end with an error")
                try:
                    self.server.restart(check=LoadWatch(self.server, grace_s=self.load_grace_s).check)
                except Exception as e:  # noqa: BLE001
                    first_line = (str(e).splitlines() or [repr(e)])[0]  # an exception may have no message
                    self._event("tritonserver", "load_failed", f"attempt {attempt}: {first_line}")
                    continue
                remove_shm_regions(regions)  # the others went with the old server (TritonServer._kill)
                self._rebaseline()
                self._event("tritonserver", "restarted", f"in {time.monotonic() - t0:.1f} s; every model ready")
                return
            self._event("tritonserver", "gave_up", "3 restarts failed; the launcher exits")
        finally:
            with self._lock:
                self._busy.clear()
            self.server.restart_done()

    def _done(self, model: str) -> None:
        with self._lock:
            self._busy.discard(model)
