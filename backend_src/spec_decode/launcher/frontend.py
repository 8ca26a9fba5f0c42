"""The OpenAI-compatible frontend beside tritonserver: a ``python -m spec_decode.openai_api`` process that the launcher
starts once every model is ready, waits for, and brings back when it dies (as the healer brings back a model
process), so ``/v1`` keeps answering while tritonserver serves. docs/openai.md and docs/deployment.md describe it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .events import Event, stderr_line
from .repository import REPO_ROOT


def tokenizer_path(repository: Path) -> str:
    """generate's ``tokenizer_path`` parameter in ``repository`` (``default`` when its config cannot be read): the
    folder whose tokenizer and chat template the frontend uses, so it renders prompts for the model generate
    tokenises for."""
    from ..serving.adapter import sibling_parameters

    params = sibling_parameters({"model_repository": str(Path(repository) / "generate")}, "generate") or {}
    return params.get("tokenizer_path", "default")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that started it ends (Linux ``PR_SET_PDEATHSIG``), so a
    launcher killed with SIGKILL does not leave the frontend holding its port. Elsewhere: nothing."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


class OpenAIFrontend:
    """The frontend process: started, watched (restarted when it dies) and stopped.

    Args:
        grpc_url: Triton's gRPC endpoint (``host:port``) it talks to.
        port: the port it listens on.
        host: the address it listens on (the launcher's HOST).
        tokenizer: the target's model folder, or ``default`` (:func:`tokenizer_path`).
        api_key: when set, clients must send it as a bearer token (passed in the environment, not the command line).
        served_names: the model names clients send (default: the tokenizer folder's name).
        log_path: file for its output (None: the terminal).
        log: called with each event's message (default: a line on stderr, like the healer's).
        extra_args: more options of ``python -m spec_decode.openai_api`` (e.g. ``("--http", "h11")``).
    """

    def __init__(self, grpc_url: str, port: int, host: str = "127.0.0.1", tokenizer: str = "default",
                 api_key: str = "", log_path: Path | None = None, log: Callable[[str], object] | None = None,
                 served_names: tuple[str, ...] = (), extra_args: tuple[str, ...] = ()):
        self.grpc_url, self.port, self.host, self.served_names = grpc_url, port, host, tuple(served_names)
        self.extra_args = tuple(extra_args)
        self.tokenizer, self.api_key, self.log_path = tokenizer, api_key, log_path
        self.proc: subprocess.Popen | None = None
        self.events: list[Event] = []
        self._log = log or stderr_line
        self._out: IO[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` to reach it locally."""
        local = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{local}:{self.port}"

    @property
    def served_name(self) -> str:
        """The (first) model name the frontend serves: ``served_names[0]``, else the tokenizer folder's name."""
        if self.served_names:
            return self.served_names[0]
        from ..engine.model_loading import resolve_model_path
        from ..openai_api.app import served_name

        return served_name(resolve_model_path(self.tokenizer))

    def start(self) -> OpenAIFrontend:
        """Start the process (returns at once; :meth:`wait_ready` waits for it)."""
        import os

        cmd = [sys.executable, "-m", "spec_decode.openai_api", "--grpc-url", self.grpc_url, "--host", self.host,
               "--port", str(self.port), "--tokenizer", self.tokenizer]
        for name in self.served_names:
            cmd += ["--served-model-name", name]
        cmd += list(self.extra_args)
        env = dict(os.environ, OPENAI_API_KEY=self.api_key,
                   PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "backend_src"), os.environ.get("PYTHONPATH", "")]))
        if self.log_path is not None and self._out is None:
            self._out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, preexec_fn=_die_with_parent,
                                     stderr=subprocess.STDOUT if self._out is not None else None)
        return self

    def health(self) -> int | None:
        """The status of ``GET /health`` (200 ready, 503 Triton not ready), or None when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until ``/health`` answers 200, then watch the process (:meth:`watch`).

        Raises:
            RuntimeError: the process exited, or was not ready within ``timeout`` seconds.
        """
        self._wait(timeout)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="spec-decode-openai-watch", daemon=True)
            self._thread.start()

    def _wait(self, timeout: float, ready: bool = True) -> None:
        """Wait for ``/health`` to answer 200 (``ready``), or to answer at all (a restart while Triton itself may be
        restarting)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenAI frontend exited with code {self.proc.returncode} (port {self.port} "
                                   f"taken? its output above says why)")
            status = self.health()
            if status == 200 or (status is not None and not ready):
                return
            time.sleep(0.25)
        raise RuntimeError(f"the OpenAI frontend did not answer on {self.url}/health within {timeout:.0f} s")

    def _event(self, what: str, detail: str) -> None:
        self.events.append(Event(time.monotonic(), "openai_frontend", what, detail))
        self._log(f"openai_frontend: {what}: {detail}")

    def _watch(self, poll_s: float = 0.5) -> None:
        while not self._stop.wait(poll_s):
            proc = self.proc
            if proc is None or proc.poll() is None:
                continue
            self._event("died", f"process {proc.pid} exited with code {proc.returncode}")
            for attempt in range(1, 6):
                if self._stop.is_set():
                    return
                t0 = time.monotonic()
                try:
                    self.start()._wait(60.0, ready=False)
                except RuntimeError as e:
                    self._event("restart_failed", f"attempt {attempt}: {e}")
                    if self.proc is not None and self.proc.poll() is None:
                        self.proc.kill()
                    time.sleep(min(2.0 ** attempt, 30.0))
                    continue
                pid = self.proc.pid if self.proc is not None else "?"
                self._event("restarted", f"in {time.monotonic() - t0:.1f} s (process {pid})")
                break
            else:
                self._event("gave_up", "5 restarts failed; /v1 is down while Triton serves on")
                return

    def stop(self, timeout: float = 10.0) -> None:
        """Stop watching, SIGTERM the process and wait for it (SIGKILL after ``timeout`` seconds)."""
        self._stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._out is not None:
            self._out.close()
            self._out = None
