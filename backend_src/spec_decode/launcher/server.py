"""The server: a tritonserver process serving the model repository, started, restarted and stopped by the launcher.

tritonserver runs with explicit model control (every model loaded at start) and its model repository API (index,
load, unload) restricted to requests that carry :data:`REPOSITORY_KEY_HEADER` with a random key made at each start, so
clients on the served ports cannot load or unload models. Its model processes are healed by
:class:`~spec_decode.launcher.healer.Healer`.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import psutil

from .embedded import server_command
from .healer import Healer
from .processes import free_ports, kill_stubs, process_rss
from .repository import DEFAULT_REPOSITORY, MODELS

# HTTP header (gRPC metadata key) that Triton's model repository API (index, load, unload) demands; its value is a
# random key made at each start and known only to the launcher (it is on tritonserver's command line, so readable by
# local processes that may read /proc of that user).
REPOSITORY_KEY_HEADER = "spec-decode-repository-key"


def _http_ok(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 within 2 s (not up yet, refused or another status: False)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status == 200
    except (OSError, ValueError):  # URLError, HTTPError, connection refused or reset, timeouts
        return False


class TritonServer:
    """A tritonserver process serving a model repository, optionally healed.

    Only this object can call the model repository API (:meth:`repository_call`), over HTTP and gRPC alike (module
    docstring). ``proc`` is the current tritonserver process: None until :meth:`start`, replaced by each restart.

    Args:
        repository: the model repository folder.
        http_port, grpc_port, metrics_port: ports (0 = pick a free one).
        log_path: file for the server's stdout/stderr (None = inherit the terminal).
        log_verbose: tritonserver --log-verbose level.
        heal: once every model is ready (:meth:`wait_ready`), watch the model processes and bring a dead one back
            (:class:`~spec_decode.launcher.healer.Healer`, kept as ``self.healer``).
        host: address the three endpoints listen on (``0.0.0.0`` in a container).
    """

    def __init__(self, repository: Path = DEFAULT_REPOSITORY, http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, log_path: Path | None = None, log_verbose: int = 0, heal: bool = True,
                 host: str = "127.0.0.1"):
        self.repository = Path(repository)
        ports = free_ports(3)
        self.http_port = http_port or ports[0]
        self.grpc_port = grpc_port or ports[1]
        self.metrics_port = metrics_port or ports[2]
        self.log_path = log_path
        self.log_verbose = log_verbose
        self.heal = heal
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.healer: Healer | None = None
        self.generation = 0  # starts so far (a restart by the healer is a new generation)
        self._log: IO[bytes] | None = None
        self._key = ""
        self._cond = threading.Condition()
        self._restarting = False
        self._stopping = False

    @property
    def _local(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def http_url(self) -> str:
        """host:port of the HTTP endpoint."""
        return f"{self._local}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port of the gRPC endpoint."""
        return f"{self._local}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """host:port of the Prometheus metrics endpoint (``/metrics``)."""
        return f"{self._local}:{self.metrics_port}"

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError("tritonserver has not been started")
        return self.proc

    def model_rss(self) -> dict[str, int]:
        """Resident memory of tritonserver and of each of its Python-backend model processes.

        Returns:
            RSS in bytes, keyed ``tritonserver`` and by model name (:func:`~.processes.process_rss`).

        Raises:
            RuntimeError: the server is not running.
        """
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("tritonserver is not running")
        try:
            return process_rss(self.proc.pid, self.repository)
        except psutil.NoSuchProcess as e:
            raise RuntimeError("tritonserver is not running") from e

    def start(self) -> TritonServer:
        """Launch tritonserver; returns ``self`` at once (see :meth:`wait_ready`).

        Raises:
            FileNotFoundError: no tritonserver to run (:func:`~.embedded.server_command`).
        """
        cmd, env = server_command()
        self._key = secrets.token_urlsafe(24)
        restricted = f"model-repository:{REPOSITORY_KEY_HEADER}={self._key}"
        cmd += [
            f"--model-repository={self.repository}", "--model-control-mode=explicit", "--load-model=*",
            f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
            f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.log_verbose}", "--exit-timeout-secs=10",
        ]
        if self.log_path is not None and self._log is None:
            self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT if self._log is not None else None)
        self.generation += 1
        return self

    def wait_ready(self, timeout: float = 600.0, models: Iterable[str] = MODELS,
                   check: Callable[[], None] | None = None) -> None:
        """Block until every model is READY; then, with ``heal``, start the healer (once).

        Args:
            timeout: seconds to wait.
            models: the models that must be READY.
            check: called at every look (every 0.5 s) while waiting; what it raises ends the wait.

        Raises:
            RuntimeError: the server was not started, exited (its log tail is included) or did not get ready within
                ``timeout``.
        """
        proc = self._started()
        deadline = time.monotonic() + timeout
        # HTTP readiness probes with the standard library (no client to install: the GPU machine runs this too);
        # urllib closes each connection, so none holds up the server's shutdown
        paths = ["/v2/health/live", *(f"/v2/models/{m}/ready" for m in models)]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {proc.returncode}\n{self.log_tail()}")
            if check is not None:
                check()
            if all(_http_ok(f"http://{self.http_url}{p}") for p in paths):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"tritonserver not ready after {timeout:.0f} s\n{self.log_tail()}")
        if self.heal and self.healer is None:
            self.healer = Healer(self).start()

    def repository_call(self, action: str, model: str = "", config: dict | None = None) -> list[dict]:
        """Call Triton's model repository API with the launcher's key.

        Args:
            action: ``load``, ``unload`` (of ``model``; blocks until done) or ``index`` (every model and its state).
            config: for ``load``, a whole model configuration (Triton's JSON form, as ``get_model_config`` returns it)
                that replaces the model's config.pbtxt for this load.

        Returns:
            For ``index``, Triton's list of ``{"name", "version", "state", "reason"}``; else ``[]``.

        Raises:
            tritonclient.utils.InferenceServerException: Triton refused or failed (e.g. the model failed to load).
        """
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.http_url, connection_timeout=600.0, network_timeout=600.0)
        headers = {REPOSITORY_KEY_HEADER: self._key}
        try:
            if action == "index":
                return client.get_model_repository_index(headers=headers)
            if action == "load":
                client.load_model(model, headers=headers, config=None if config is None else json.dumps(config))
            elif action == "unload":
                client.unload_model(model, headers=headers)
            else:
                raise ValueError(f"action must be load, unload or index, not {action!r}")
            return []
        finally:
            client.close()

    def reload(self, model: str, config: dict | None = None) -> None:
        """Load ``model`` again, with ``config`` (Triton's JSON form of a whole model configuration, as
        ``get_model_config`` returns it) in place of its config.pbtxt, while the rest serves: Triton starts the new
        processes and ends the old ones once they are loaded; when the load fails, the model serves on as it was. The
        healer (if any) is told, so the old processes ending is not taken for a death.

        Raises:
            tritonclient.utils.InferenceServerException: Triton refused or failed the load (its message says why).
            RuntimeError: the healer is bringing this model or the server back right now.
        """
        if self.healer is None:
            self.repository_call("load", model, config)
            return
        with self.healer.replacing(model):
            self.repository_call("load", model, config)

    def load_unready_models(self) -> None:
        """Load every model of the repository that is not READY (e.g. an ensemble unloaded with one of its steps).

        Raises:
            tritonclient.utils.InferenceServerException: a load failed.
        """
        for m in self.repository_call("index"):
            if m.get("state") != "READY":
                self.repository_call("load", m["name"])

    def _kill(self, proc: subprocess.Popen | None = None) -> None:
        """SIGKILL tritonserver (``proc``, default the current one), then its model processes, which outlive it
        (:func:`~.processes.kill_stubs`)."""
        proc = proc or self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_stubs(proc.pid, self.repository)

    def restart(self, timeout: float = 600.0, check: Callable[[], None] | None = None) -> None:
        """Kill tritonserver and its model processes, start it again on the same ports, wait until every model is
        ready. :meth:`wait` does not return meanwhile; the caller must call :meth:`restart_done` afterwards.

        Args:
            timeout: seconds to wait for the new server.
            check: called at every look while waiting for the new server (:meth:`wait_ready`).

        Raises:
            RuntimeError: :meth:`stop` was called, or the new server did not get ready (it is killed again).
            Exception: what ``check`` raised (the new server is killed).
        """
        with self._cond:
            if self._stopping:
                raise RuntimeError("the launcher is stopping")
            self._restarting = True
        self._kill()
        with self._cond:  # stop() either saw the old process (dead) or sees this one
            if self._stopping:
                raise RuntimeError("the launcher is stopping")
            self.start()
        try:
            self.wait_ready(timeout, check=check)
        except Exception:
            self._kill()
            raise

    def restart_done(self) -> None:
        """End a :meth:`restart` (successful or not), releasing :meth:`wait`."""
        with self._cond:
            self._restarting = False
            self._cond.notify_all()

    def wait(self) -> int:
        """Block until tritonserver exits by itself (restarts by the healer do not count).

        Returns:
            Its ``Popen.returncode`` (negative: killed by that signal).

        Raises:
            RuntimeError: the server was not started.
        """
        while True:
            proc = self._started()
            code = proc.wait()
            with self._cond:
                while self._restarting:
                    self._cond.wait()
                if self.proc is proc:
                    return code

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server log (when logging to a file)."""
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 40.0) -> None:
        """Stop the healer, SIGINT the server and wait for it to exit (SIGKILL after ``timeout`` seconds; at once while
        the healer restarts it, since it is not serving then), and kill any model process left behind."""
        with self._cond:
            self._stopping = True
            proc, restarting = self.proc, self._restarting
        if self.healer is not None:
            self.healer.stop()
        if proc is not None and proc.poll() is None and not restarting:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill(proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
