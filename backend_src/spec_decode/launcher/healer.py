"""Self-healing for a running tritonserver: find each model's Python process, notice when one dies, bring it back.

Triton 2.51's Python backend does not restart a model process (``triton_python_backend_stub``) that dies (an
out-of-memory kill, a crash in a native library): from then on every request to that model fails with "Stub process
'<instance>' is not healthy" while ``/v2/health/ready`` and the model's ready endpoint still answer 200 (upstream
triton-inference-server/server issues #7862 and #8604). :class:`Healer` watches the stubs of a server started by
:class:`spec_decode.server.TritonServer` and, within about one poll interval of a death:

- a model whose requests are not decoupled (the step models) is unloaded and loaded again through Triton's model
  repository API (explicit model control, a restricted-API key only the launcher knows); the other models go on
  serving, and Triton reports the server and that model not ready until the load returns. Requests waiting on the dead
  process fail with the backend's "not healthy" error, so every ``generate`` stream stepping through it ends with an
  error response; caches rebuild on demand in the fresh process (each step carries what a cache miss needs).
- a decoupled model (``generate``, the client entry point) is different: its in-flight requests belonged to the dead
  process and Triton never ends them, not after an unload and reload of the model either (measured: client streams
  still open 150 s later, and tritonserver then ignores SIGINT because those requests never finish). So the whole
  server is restarted on the same ports (SIGKILL, start, wait until every model is ready), which closes every client
  connection: their streams end at once with a transport error (gRPC ``UNAVAILABLE``) instead of waiting forever.

A new process that dies while its model loads (a second fault during recovery) leaves Triton's load waiting forever,
so :class:`LoadWatch` looks for that and the healer restarts the whole server; a load that fails otherwise is retried,
and after ``max_attempts`` failures the whole server is restarted too. After 3 failed restarts the healer gives up and
the launcher exits non-zero.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .server import TritonServer


class StubProcess(NamedTuple):
    """One Python-backend model process of a tritonserver.

    Attributes:
        pid: its process id.
        model: the model's folder name in the repository (e.g. ``target_model``).
        instance: Triton's instance name (e.g. ``target_model_0_0``), or the model's name for the short-lived process
            the backend starts at the beginning of a load to complete the model's configuration.
        shm_region: the name of its shared-memory region under ``/dev/shm`` ("" if not found).
    """

    pid: int
    model: str
    instance: str
    shm_region: str = ""

    @property
    def serves(self) -> bool:
        """Whether this is a model instance's process (the one that serves requests)."""
        return self.instance != self.model


def stub_processes(server_pid: int, repository: Path, orphans: bool = False) -> list[StubProcess]:
    """The ``triton_python_backend_stub`` processes of a tritonserver, from ``/proc`` (Linux only).

    A stub's command line holds its model's ``model.py`` path (under ``repository``), its parent's pid and its
    instance name; processes that vanish while being read, and children that are not model stubs, are skipped.

    Args:
        server_pid: tritonserver's process id.
        repository: the model repository it serves.
        orphans: also the stubs left behind by that tritonserver after it died (no longer its children, but their
            command line still names it).

    Returns:
        One :class:`StubProcess` per live stub, in no particular order.
    """
    repo = str(Path(repository).resolve())
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            running, ppid = _state(int(entry.name))
            if not running or (ppid != server_pid and not orphans):
                continue
            args = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
            i = next(i for i, a in enumerate(args) if a.startswith(repo + "/") and a.endswith(".py"))
            if ppid != server_pid and str(server_pid) not in args[i + 1:]:
                continue
            model = Path(args[i]).relative_to(repo).parts[0]
            instance = next((a for a in args[i + 1:] if a.startswith(model + "_")), model)
            region = next((a for a in args[i + 1:] if a.startswith(SHM_PREFIX)), "")
            out.append(StubProcess(int(entry.name), model, instance, region))
        except (OSError, StopIteration, IndexError, ValueError):
            continue  # gone, or not a model stub
    return out


def _config(cfg: Path) -> str:
    return "\n".join(line.split("#", 1)[0] for line in cfg.read_text().splitlines())


SHM_PREFIX = "triton_python_backend_shm_region_"


def remove_shm_regions(names) -> None:
    """Unlink the ``/dev/shm`` regions of model processes that are gone (Triton leaves a dead process's 1 MiB region
    behind). Names that are not Python-backend regions, and regions already gone, are skipped; a mapping that still
    exists stays valid (POSIX unlink semantics)."""
    for name in names:
        if name.startswith(SHM_PREFIX) and "/" not in name:
            try:
                os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass


def _state(pid: int) -> tuple[bool, int]:
    """(runs: neither a zombie nor dead, parent pid) from ``/proc/<pid>/stat``.

    Raises:
        OSError: no such process.
    """
    state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    return state not in ("Z", "X"), int(ppid)


def process_alive(pid: int, parent_pid: int) -> bool:
    """Whether process ``pid`` runs (not a zombie) as a child of ``parent_pid``: one read of ``/proc/<pid>/stat``, so
    cheap enough to look often (a pid reused by another process has another parent)."""
    try:
        return _state(pid) == (True, parent_pid)
    except OSError:
        return False


_DECOUPLED = re.compile(r"model_transaction_policy\s*\{[^}]*decoupled\s*:\s*true", re.S)
_PYTHON = re.compile(r'^\s*backend\s*:\s*"python"', re.M)


def decoupled_models(repository: Path) -> set[str]:
    """Names of the repository's models whose ``config.pbtxt`` sets ``model_transaction_policy { decoupled: true }``."""
    return {cfg.parent.name for cfg in Path(repository).glob("*/config.pbtxt") if _DECOUPLED.search(_config(cfg))}


def python_models(repository: Path) -> set[str]:
    """Names of the repository's models served by the Python backend (``backend: "python"``): those with processes."""
    return {cfg.parent.name for cfg in Path(repository).glob("*/config.pbtxt") if _PYTHON.search(_config(cfg))}


class DiedWhileLoading(RuntimeError):
    """A model's process died while Triton was loading the model."""


class LoadWatch:
    """Watch a server while models load, for a model process that dies before its load returns: Triton 2.51's Python
    backend then waits for the dead process forever, so that load would never return.

    A model is taken to have died while loading when a process of it seen by an earlier look is gone, or, for a process
    killed between two looks, when Triton has reported the model ``LOADING`` (repository index) for over ``grace_s``
    with none of its processes alive. The backend starts a model's processes as its load begins, but a load may also
    wait, with no process, for the same model's earlier instance to finish unloading (measured: up to several seconds
    while requests to the dead process time out), so ``grace_s`` is generous.

    Args:
        server: the :class:`~spec_decode.server.TritonServer`; the tritonserver process running at the first
            :meth:`check` is the one watched.
        model: watch only this model (None: every Python-backend model of the repository).
        grace_s: seconds a model may be LOADING with no process of its own.
    """

    def __init__(self, server: TritonServer, model: str | None = None, grace_s: float = 20.0):
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
            self.pid = self.server.proc.pid
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

    def run(self, fn, poll_s: float):
        """Call ``fn()`` (a blocking load) in a thread, looking every ``poll_s`` s while it runs; returns its result.

        Raises:
            DiedWhileLoading: as :meth:`check` (``fn`` is left to fail when the server is killed).
            Exception: whatever ``fn`` raised.
        """
        result: dict = {}

        def call():
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
        return result.get("value")


class Event(NamedTuple):
    """A healer event, for logs and tests.

    Attributes:
        t: ``time.monotonic()`` when it happened (s).
        model: the model concerned (``tritonserver`` for whole-server events).
        what: ``died``, ``reloading``, ``reloaded``, ``load_failed``, ``restarting``, ``restarted`` or ``gave_up``.
        detail: a human-readable detail (pids, durations, the error).
    """

    t: float
    model: str
    what: str
    detail: str


def _stderr_line(msg: str) -> None:
    """The healer's default log: one write per line, so that lines from concurrent recoveries do not run together."""
    sys.stderr.write(f"[spec_decode.healing] {msg}\n")
    sys.stderr.flush()


class Healer:
    """Watch a :class:`~spec_decode.server.TritonServer`'s model processes and bring dead ones back (module docstring).

    Args:
        server: a started server whose models are all ready (the healer takes the live stubs as the expected set).
        poll_s: seconds between two looks at ``/proc``; a death is acted on within about this long (during a load,
            every ``min(poll_s, 0.1)`` s).
        max_attempts: loads of one model to try before restarting the whole server instead.
        log: called with each event's message (default: print to stderr).
        load_grace_s: :class:`LoadWatch`'s ``grace_s``.

    The healer runs in a daemon thread between :meth:`start` and :meth:`stop`. It never acts when tritonserver itself
    has exited: that is the launcher's business (it exits non-zero so a supervisor restarts it).
    """

    def __init__(self, server: TritonServer, poll_s: float = 0.25, max_attempts: int = 5, log=None,
                 load_grace_s: float = 20.0):
        self.server = server
        self.poll_s = poll_s
        self.max_attempts = max_attempts
        self.load_grace_s = load_grace_s
        self.events: list[Event] = []
        self._log = log or _stderr_line
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
        """Stop watching (a reload or restart in progress finishes in its own thread, or is abandoned at exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

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
        for s in stub_processes(self.server.proc.pid, self.server.repository):
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
        """Look once (one read of ``/proc/<pid>/stat`` per expected process): act on every model whose expected
        process is gone. Returns the models acted on."""
        proc = self.server.proc
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

    def _reload(self, model: str, generation: int, regions=()) -> None:
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
                stubs = [s for s in stub_processes(self.server.proc.pid, self.server.repository)
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

    def _restart(self, model: str, generation: int, regions=()) -> None:
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
                    self._event("tritonserver", "load_failed", f"attempt {attempt}: {str(e).splitlines()[0]}")
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
