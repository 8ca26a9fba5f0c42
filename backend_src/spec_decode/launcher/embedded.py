"""The tritonserver to run: one on PATH, or the embedded one that the ``nvidia-pytriton`` wheel ships.

The embedded server is tritonserver 2.51 from ``nvidia-pytriton==0.7.0``, laid out once under the cache (``bin``,
``backends``, ``caches`` and the Python backend stub for this interpreter's version) and run with the wheel's bundled
libraries on LD_LIBRARY_PATH and the virtual environment first on PATH, so that the stub imports the venv's packages.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from ..engine.model_loading import cache_dir


def pytriton_root() -> Path:
    """The installed ``pytriton`` package's folder (its ``tritonserver``; its libraries beside it).

    Raises:
        FileNotFoundError: nvidia-pytriton is not installed (``make setup`` installs it).
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed (make setup installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_server_dir() -> Path:
    """Lay out the embedded tritonserver under the cache, once.

    Returns:
        Its folder (``bin/tritonserver``, ``backends``, ``caches``).

    Raises:
        FileNotFoundError: nvidia-pytriton is not installed.
    """
    root = pytriton_root() / "tritonserver"
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
    """The tritonserver command prefix and its environment.

    In order: the server folder named by ``SPEC_DECODE_TRITONSERVER_DIR`` (laid out as :func:`embedded_server_dir`
    lays one out, with its libraries in ``lib``: the travelling bundle of ``bench/gpu_day/bundle.py``), PATH's
    ``tritonserver`` (unless ``SPEC_DECODE_EMBEDDED_SERVER=1``), else the embedded one (:func:`embedded_server_dir`).

    Returns:
        (the command without tritonserver's model and endpoint options, the environment to run it in).

    Raises:
        FileNotFoundError: ``SPEC_DECODE_TRITONSERVER_DIR`` has no ``bin/tritonserver``; or no tritonserver on PATH
            and nvidia-pytriton is not installed.
    """
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    folder = os.environ.get("SPEC_DECODE_TRITONSERVER_DIR", "")
    if folder:
        d = Path(folder)
        if not (d / "bin" / "tritonserver").is_file():
            raise FileNotFoundError(f"SPEC_DECODE_TRITONSERVER_DIR={folder}: no bin/tritonserver there")
        libs = [str(d / "lib")]
    else:
        on_path = shutil.which("tritonserver", path=os.environ.get("PATH", ""))
        if on_path and os.environ.get("SPEC_DECODE_EMBEDDED_SERVER") != "1":
            return [on_path], env
        d = embedded_server_dir()
        libs = [str(pytriton_root().parent / "nvidia_pytriton.libs")]
    # The stub links libpython3.X.so.1.0: make it load the same libpython as this interpreter (whose stdlib the venv
    # uses), not whichever the system has, or extension modules fail with undefined symbols.
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and (Path(libdir) / f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0").exists():
        libs.insert(0, libdir)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return [str(d / "bin" / "tritonserver"), f"--backend-directory={d / 'backends'}"], env
