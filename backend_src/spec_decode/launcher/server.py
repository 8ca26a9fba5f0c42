"""Start a real tritonserver on the model repository: the embedded one from nvidia-pytriton, or one on PATH.

``python -m spec_decode.server`` (what ``make serve`` runs) prepares the default model, starts tritonserver on
127.0.0.1 with HTTP_PORT, GRPC_PORT and METRICS_PORT (defaults 8000, 8001, 8002), waits until every model is READY,
prints the ports and a client command, and serves until interrupted. Tests use :class:`TritonServer` on free ports.

The embedded server is tritonserver 2.51 from ``nvidia-pytriton==0.7.0`` laid out once under the cache
(``bin``, ``backends``, ``caches`` and the Python 3.11 backend stub), run with its bundled libraries on
LD_LIBRARY_PATH and the virtual environment first on PATH so the stub imports the venv's packages.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from ..engine.model_loading import cache_dir, prepare_default_model
from .healer import Healer, remove_shm_regions, stub_processes

MODELS = ("generate", "spec_step", "score_step", "draft_model", "target_model", "verifier")
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"
# HTTP header (gRPC metadata key) that Triton's model repository API (index, load, unload) demands; its value is a
# random key made at each start and known only to the launcher (it is on tritonserver's command line, so readable by
# local processes that may read /proc of that user).
REPOSITORY_KEY_HEADER = "spec-decode-repository-key"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free right now (bound together, so no two are the same: ports
    taken one after the other could be, and tritonserver refuses to start with gRPC and metrics on one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed and no tritonserver is on PATH")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_server_dir() -> Path:
    """Lay out the embedded tritonserver once and return its folder."""
    root = _pytriton_root() / "tritonserver"
    dest = cache_dir() / f"tritonserver-py{sys.version_info.major}.{sys.version_info.minor}"
    stub = (root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
            / "triton_python_backend_stub")
    if (dest / "bin" / "tritonserver").exists() and (dest / "backends" / "python" / stub.name).exists():
        return dest
    tmp = Path(tempfile.mkdtemp(dir=dest.parent if dest.parent.exists() else None))
    for sub in ("bin", "backends", "caches"):
        shutil.copytree(root / sub, tmp / sub, symlinks=True)
    shutil.copy2(stub, tmp / "backends" / "python" / stub.name)
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    return dest


def server_command() -> tuple[list[str], dict[str, str]]:
    """The tritonserver command prefix and environment: PATH's ``tritonserver`` if any, else the embedded one."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    on_path = shutil.which("tritonserver", path=os.environ.get("PATH", ""))
    if on_path and os.environ.get("SPEC_DECODE_EMBEDDED_SERVER") != "1":
        return [on_path], env
    d = embedded_server_dir()
    libs = [str(_pytriton_root().parent / "nvidia_pytriton.libs")]
    # The stub links libpython3.X.so.1.0: make it load the same libpython as this interpreter (whose stdlib the venv
    # uses), not whichever the system has, or extension modules fail with undefined symbols.
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and (Path(libdir) / f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0").exists():
        libs.insert(0, libdir)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return [str(d / "bin" / "tritonserver"), f"--backend-directory={d / 'backends'}"], env


_PARAM = r'(parameters:\s*\{{\s*key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*)"[^"]*"'


def _quoted_value(value: str, m: re.Match) -> str:
    """Replacement for a ``_PARAM`` match: the text before the value, then ``value`` quoted (no escape processing)."""
    return m.group(1) + f'"{value}"'


def prepare_repository(overrides: dict[str, dict[str, str]] | None = None, src: Path = DEFAULT_REPOSITORY) -> Path:
    """The model repository to serve: ``src`` itself, or a copy with config parameters overridden.

    Args:
        overrides: model name -> {parameter key -> string value}, e.g. ``{"draft_model": {"draft_model_path": p}}``.

    Raises:
        KeyError: an override names a parameter that the model's config.pbtxt does not have.
    """
    if not overrides:
        return src
    dst = Path(tempfile.mkdtemp(prefix="spec_decode_repo_"))
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for model, params in overrides.items():
        cfg = dst / model / "config.pbtxt"
        text = cfg.read_text()
        for key, value in params.items():
            text, n = re.subn(_PARAM.format(key=re.escape(key)), partial(_quoted_value, value), text)
            if n != 1:
                raise KeyError(f"{model}/config.pbtxt has no parameter {key!r}")
        cfg.write_text(text)
    return dst


def draft_overrides(draft_model_path: str) -> dict[str, dict[str, str]]:
    """Config overrides that serve ``draft_model_path`` as the draft LM and enable speculative_method=draft."""
    return {
        "draft_model": {"draft_model_path": draft_model_path},
        "generate": {"draft_model_available": "true"},
    }


def served_methods(repo: Path) -> str:
    """The ``speculative_method`` values the repository ``repo`` offers its clients, comma-separated, as generate
    computes them from draft_model's and its own config parameters (for the launcher's banner; "?" when the configs
    cannot be read)."""
    from ..proposers import offered_methods
    from ..serving.adapter import sibling_parameters

    own = {"model_repository": str(repo / "generate")}
    draft, gen = sibling_parameters(own, "draft_model"), sibling_parameters(own, "generate")
    if draft is None or gen is None:
        return "?"
    forced = gen.get("draft_model_available", "auto")
    try:
        return ", ".join(offered_methods(draft, None if forced == "auto" else forced == "true"))
    except ValueError as e:
        return f"? ({e})"


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def process_rss(server_pid: int, repository: Path) -> dict[str, int]:
    """RSS in bytes of a tritonserver (key ``tritonserver``) and of its model stubs (key: model name, ``name#i`` for
    further instances); a stub is matched to its model by the model folder in its command line."""
    out = {"tritonserver": _rss_bytes(server_pid)}
    for stub in stub_processes(server_pid, repository):
        key, i = stub.model, 1
        while key in out:
            key, i = f"{stub.model}#{i}", i + 1
        try:
            out[key] = _rss_bytes(stub.pid)
        except OSError:
            continue  # gone
    return out


class TritonServer:
    """A tritonserver process serving a model repository, optionally healed (:mod:`spec_decode.healing`).

    tritonserver runs with explicit model control (every model loaded at start) and its model repository API
    (index, load, unload) restricted to requests that carry :data:`REPOSITORY_KEY_HEADER` with a random key made at
    each start, over HTTP and gRPC: clients on the served ports cannot load or unload models; only this object can
    (:meth:`repository_call`).

    Args:
        repository: the model repository folder.
        http_port, grpc_port, metrics_port: ports (0 = pick a free one).
        log_path: file for the server's stdout/stderr (None = inherit the terminal).
        log_verbose: tritonserver --log-verbose level.
        heal: once every model is ready (:meth:`wait_ready`), watch the model processes and bring a dead one back
            (:class:`spec_decode.healing.Healer`, kept as ``self.healer``).
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
        self._log = None
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

    def model_rss(self) -> dict[str, int]:
        """Resident memory (bytes) of each Python-backend model process (the ``triton_python_backend_stub`` children of
        this server), keyed by model name; ``tritonserver`` is the server process itself. Linux only (reads /proc).

        Raises:
            RuntimeError: the server is not running.
        """
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("tritonserver is not running")
        return process_rss(self.proc.pid, self.repository)

    def start(self) -> TritonServer:
        """Launch tritonserver (returns at once; see :meth:`wait_ready`)."""
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

    def wait_ready(self, timeout: float = 600.0, models=MODELS, check=None) -> None:
        """Block until every model is READY; then, with ``heal``, start the healer (once).

        Args:
            check: called at every look (every 0.5 s) while waiting; what it raises ends the wait.

        Raises:
            RuntimeError: the server exited (its log tail is included) or did not get ready within ``timeout`` s.
        """
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.http_url)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}\n{self.log_tail()}")
                if check is not None:
                    check()
                try:
                    if client.is_server_live() and all(client.is_model_ready(m) for m in models):
                        break
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError(f"tritonserver not ready after {timeout:.0f} s\n{self.log_tail()}")
        finally:
            client.close()  # an open keep-alive connection would hold up the server's shutdown
        if self.heal and self.healer is None:
            self.healer = Healer(self).start()

    def repository_call(self, action: str, model: str = "") -> list[dict]:
        """Call Triton's model repository API with the launcher's key.

        Args:
            action: ``load``, ``unload`` (of ``model``; blocks until done) or ``index`` (every model and its state).

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
            {"load": client.load_model, "unload": client.unload_model}[action](model, headers=headers)
            return []
        finally:
            client.close()

    def load_unready_models(self) -> None:
        """Load every model of the repository that is not READY (e.g. an ensemble unloaded with one of its steps).

        Raises:
            tritonclient.utils.InferenceServerException: a load failed.
        """
        for m in self.repository_call("index"):
            if m.get("state") != "READY":
                self.repository_call("load", m["name"])

    def _kill(self, proc: subprocess.Popen | None = None) -> None:
        """SIGKILL tritonserver (``proc``, default the current one) and then its model processes, which would otherwise
        linger after their parent (also those a tritonserver that already died left behind), and remove their shared
        memory regions."""
        proc = proc or self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stubs = stub_processes(proc.pid, self.repository, orphans=True)
        for stub in stubs:
            try:
                os.kill(stub.pid, signal.SIGKILL)
            except OSError:
                pass
        remove_shm_regions(s.shm_region for s in stubs)

    def restart(self, timeout: float = 600.0, check=None) -> None:
        """Kill tritonserver and its model processes, start it again on the same ports, wait until every model is
        ready. :meth:`wait` does not return meanwhile; the caller must call :meth:`restart_done` afterwards.

        Args:
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
        """Block until tritonserver exits by itself (restarts by the healer do not count) and return its
        ``Popen.returncode``."""
        while True:
            proc = self.proc
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
        """Stop the healer, SIGINT the server and wait for it to exit (SIGKILL after ``timeout`` s; at once while the
        healer restarts it, since it is not serving then), and kill any model process left behind."""
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

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``make serve``: prepare the model, start tritonserver, print the ports once every model is READY.

    While serving, a model process that dies is brought back (:mod:`spec_decode.healing`). Returns 0 after Ctrl-C or
    SIGTERM (tritonserver is stopped first); if tritonserver dies by itself, or the healer could not restart it, a
    non-zero status and the reason on stderr (:func:`exit_status`); 1 when a model fails to load (tritonserver's log
    names it and why)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    ap.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    ap.add_argument("--draft-model", default=os.environ.get("DRAFT_MODEL", ""),
                    help="draft LM folder (or 'default' for the target itself) to enable speculative_method=draft")
    ap.add_argument("--eagle-head", default=os.environ.get("EAGLE_HEAD", ""),
                    help="EAGLE head folder (make speculator --output) to serve as speculative_method=eagle in place "
                         "of the default one")
    ap.add_argument("--log-verbose", type=int, default=0)
    ap.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"),
                    help="address to listen on (0.0.0.0 in a container)")
    args = ap.parse_args(argv)

    prepare_default_model()

    def _terminate(signum, frame):  # kill, systemd, supervisors: stop tritonserver too, as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    overrides = draft_overrides(args.draft_model) if args.draft_model else {}
    if args.eagle_head:
        overrides.setdefault("draft_model", {})["eagle_path"] = args.eagle_head
    repo = prepare_repository(overrides, args.model_repository)
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port, log_verbose=args.log_verbose,
                          host=args.host)
    server.start()
    try:
        try:
            server.wait_ready()
        except RuntimeError as e:  # a model failed to load (e.g. a config parameter out of range)
            print(f"spec_decode.launcher: {str(e).splitlines()[0]} before every model was ready; tritonserver's log "
                  f"above names the model that failed to load and why (look for 'failed to load' and 'config "
                  f"parameter')", file=sys.stderr, flush=True)
            return 1
        print(
            f"\nAll models READY.\n  HTTP    http://{server.http_url}\n  gRPC    {server.grpc_url}\n"
            f"  metrics http://{server.metrics_url}/metrics\n  speculative_method: {served_methods(repo)}\n\nTry:\n"
            f"  .venv/bin/python -m client.generate --url {server.grpc_url} --humaneval 1 --max-tokens 128\n",
            flush=True,
        )
        return exit_status(server.wait())
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def exit_status(code: int) -> int:
    """The launcher's exit status when tritonserver exited by itself (not by Ctrl-C or SIGTERM to the launcher): always
    non-zero, so a supervisor (systemd ``Restart=on-failure``, Kubernetes) restarts the whole server, with the reason
    printed to stderr.

    Args:
        code: ``Popen.returncode`` of tritonserver (negative: killed by that signal).
    """
    if code < 0:
        try:
            why = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            why = f"killed by signal {-code}"
        status = 128 - code
    else:
        why, status = f"exited with code {code}", code or 1
    print(f"tritonserver {why} while serving; the launcher exits with status {status} so that a supervisor restarts "
          f"it", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
