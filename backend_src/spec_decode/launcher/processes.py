"""Process helpers: a tritonserver's Python-backend model processes ("stubs"), whether one is alive, their memory,
their leftover shared memory, and free ports to start a server on.

Processes are found and inspected through psutil (Linux ``/proc`` underneath). A process that vanishes while it is
read is skipped; a zombie counts as dead.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import psutil

SHM_PREFIX = "triton_python_backend_shm_region_"
_DEAD = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


class StubProcess(NamedTuple):
    """One Python-backend model process (``triton_python_backend_stub``) of a tritonserver.

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
    """The live ``triton_python_backend_stub`` processes of a tritonserver.

    A stub's command line holds its model's ``model.py`` path (under ``repository``), the pid of the tritonserver
    that started it and its instance name. Zombies, processes that vanish while being read, and children that are not
    model stubs are skipped.

    Args:
        server_pid: tritonserver's process id.
        repository: the model repository it serves.
        orphans: also the stubs that tritonserver left behind when it died (no longer its children, but their command
            line still names it).

    Returns:
        One :class:`StubProcess` per live stub, in no particular order.
    """
    repo = str(Path(repository).resolve())
    candidates: Iterable[psutil.Process]
    if orphans:
        candidates = psutil.process_iter()
    else:
        try:
            candidates = psutil.Process(server_pid).children()
        except psutil.NoSuchProcess:
            return []
        except psutil.AccessDenied:  # some process's /proc/<pid>/stat is unreadable: look at each one instead
            candidates = psutil.process_iter()
    out = []
    for proc in candidates:
        try:
            with proc.oneshot():
                if proc.status() in _DEAD:
                    continue
                ppid = proc.ppid()
            if ppid != server_pid and not orphans:
                continue
            stub = _parse_stub(proc.pid, proc.cmdline(), repo, server_pid, named_only=ppid != server_pid)
        except psutil.Error:
            continue  # gone, or not ours to read
        if stub is not None:
            out.append(stub)
    return out


def _parse_stub(pid: int, args: list[str], repo: str, server_pid: int, named_only: bool) -> StubProcess | None:
    """The stub that command line ``args`` describes, or None if it is not one of ``server_pid``'s model stubs
    (``named_only``: it counts only if its arguments name ``server_pid``)."""
    try:
        i = next(i for i, a in enumerate(args) if a.startswith(repo + "/") and a.endswith(".py"))
        model = Path(args[i]).relative_to(repo).parts[0]
    except (StopIteration, IndexError, ValueError):
        return None
    rest = args[i + 1:]
    if named_only and str(server_pid) not in rest:
        return None
    instance = next((a for a in rest if a.startswith(model + "_")), model)
    region = next((a for a in rest if a.startswith(SHM_PREFIX)), "")
    return StubProcess(pid, model, instance, region)


def process_alive(pid: int, parent_pid: int) -> bool:
    """Whether process ``pid`` runs as a child of ``parent_pid``: a zombie is dead, and a pid reused by a process with
    another parent is not the process that was expected."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return proc.status() not in _DEAD and proc.ppid() == parent_pid
    except psutil.Error:
        return False


def process_rss(server_pid: int, repository: Path) -> dict[str, int]:
    """Resident memory of a tritonserver and of its model stubs.

    Returns:
        RSS in bytes, keyed ``tritonserver`` for the server and by model name for its stubs (``name#1``, ``name#2``
        for further processes of one model); a stub that exits meanwhile is left out.

    Raises:
        psutil.NoSuchProcess: no process ``server_pid``.
    """
    out = {"tritonserver": psutil.Process(server_pid).memory_info().rss}
    for stub in stub_processes(server_pid, repository):
        key, i = stub.model, 1
        while key in out:
            key, i = f"{stub.model}#{i}", i + 1
        try:
            out[key] = psutil.Process(stub.pid).memory_info().rss
        except psutil.Error:
            continue  # gone
    return out


def remove_shm_regions(names: Iterable[str]) -> None:
    """Unlink the ``/dev/shm`` regions of model processes that are gone (Triton leaves a dead process's region behind).

    Names that are not Python-backend regions, and regions already gone, are skipped; a mapping that still exists stays
    valid (POSIX unlink semantics).
    """
    for name in names:
        if name.startswith(SHM_PREFIX) and "/" not in name:
            try:
                os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass


def kill_stubs(server_pid: int, repository: Path) -> None:
    """SIGKILL the model stubs of tritonserver ``server_pid``, including those it left behind when it died, and remove
    their ``/dev/shm`` regions (stubs outlive a killed tritonserver)."""
    stubs = stub_processes(server_pid, repository, orphans=True)
    for stub in stubs:
        try:
            os.kill(stub.pid, signal.SIGKILL)
        except OSError:
            pass
    remove_shm_regions(s.shm_region for s in stubs)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free right now.

    They are bound together, so no two are the same (ports taken one after the other could be, and tritonserver
    refuses to start with two endpoints on one port).
    """
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_problems(ports: dict[str, int], host: str) -> list[str]:
    """What stops the servers from listening on ``ports`` at ``host``, checked before anything starts: a host that
    does not resolve or is no address of this machine, a value that is no TCP port, two endpoints on one port
    (tritonserver, or it and the OpenAI frontend, would fail to bind one), a port that something already listens on.

    Args:
        ports: what each port is for (e.g. ``"--http-port / HTTP_PORT"``) -> the port.
        host: the address the servers listen on (``0.0.0.0``, ``127.0.0.1``, ``::``, a name such as ``localhost``).

    Returns:
        One sentence per problem, naming the setting (``--host / HOST`` once for a bad host) and the port; empty when
        every port is free. A port is probed by binding it on every address ``host`` resolves to, as the servers will
        (``SO_REUSEADDR``, as tritonserver and uvicorn do, so a port a closed server left in TIME_WAIT counts as free);
        something may still take it before the servers start.
    """
    try:
        addresses = {(family, kind, proto, address[:2]) for family, kind, proto, _, address
                     in socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
    except socket.gaierror as e:
        return [f"--host / HOST {host!r} does not resolve ({e.strerror})"]
    problems: list[str] = []
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if not 0 < port < 65536:
            problems.append(f"{name} {port} is not a TCP port (1-65535)")
        elif port in seen:
            problems.append(f"{name} {port} is also {seen[port]}: give each endpoint its own port")
        else:
            seen[port] = name
    for port, name in seen.items():
        for family, kind, proto, address in sorted(addresses):
            try:
                with socket.socket(family, kind, proto) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((address[0], port))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    return [f"--host / HOST {host!r} is not an address of this machine ({e.strerror})"]
                problems.append(f"{name} {port} cannot be used on {address[0]}: {e.strerror or e} (another server "
                                f"on it? choose another port)")
                break
    return problems
