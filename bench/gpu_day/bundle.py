"""A tritonserver that travels: the parts of nvidia-pytriton's embedded server a CPU+CUDA tritonserver with the Python
backend needs, in one compressed tar small enough to travel to a GPU machine that has no tritonserver and no network.

    python -m bench.gpu_day.bundle [--python 3.12 3.11] [--output build/gpu_day]

The nvidia-pytriton 0.7.0 wheel (installed by ``make setup``) holds tritonserver 2.51 with GPU support: ``bin``,
``backends/python``, ``caches``, one Python backend stub per Python version (3.8-3.13) and, in
``nvidia_pytriton.libs``, 115 MB of bundled shared libraries (the CUDA 12.6 runtime among them). The bundle keeps the
binary, the Python backend, the cache, the stubs of the Python versions asked for and, of the libraries, only those
that the binary, the backend and the cache link (their ``ldd`` closure: the 31 MB libpython3.13 that pytriton's own
proxy uses is left out), all under one folder laid out as :func:`spec_decode.launcher.embedded.server_command` runs a
server folder (``SPEC_DECODE_TRITONSERVER_DIR``): ``bin``, ``backends`` (the stub copied into ``backends/python``),
``caches``, ``lib``, and ``stubs/<version>`` for the other versions. Beside it, ``site/`` holds pure-Python packages
the GPU machine lacks (``prometheus_client``, for the metrics), for ``PYTHONPATH``, and ``tokenizer/`` the embedded
model's tokenizer (the served part's random target uses its vocabulary).

Sizes measured: docs/gpus.md ("The served path on a GPU machine").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from spec_decode.launcher.embedded import pytriton_root

ROOT = Path(__file__).resolve().parents[2]
BUNDLE_NAME = "tritonserver.tar.xz"
SITE_PACKAGES = ("prometheus_client",)
"""Pure-Python packages that travel beside the bundle (``site/``), for the served part's metrics."""


def linked_libraries(files: list[Path], libs: Path) -> list[Path]:
    """The libraries of ``libs`` that ``files`` link, directly or through each other (``ldd`` with ``libs`` on
    LD_LIBRARY_PATH resolves the whole closure).

    Raises:
        subprocess.CalledProcessError: ``ldd`` failed on a file.
    """
    env = dict(os.environ, LD_LIBRARY_PATH=str(libs))
    found: set[Path] = set()
    for f in files:
        out = subprocess.run(["ldd", str(f)], env=env, check=True, capture_output=True, text=True).stdout
        for m in re.finditer(r"=>\s+(\S+)", out):
            p = Path(m.group(1)).resolve()  # the binaries' RPATH spells it $ORIGIN/../../../nvidia_pytriton.libs
            if p.parent == libs.resolve():
                found.add(p)
    return sorted(found)


def build(output: Path, pythons: list[str]) -> dict:
    """Write ``output/tritonserver.tar.xz`` (xz preset 6) and ``output/site`` (module docstring).

    Args:
        output: the folder to write (created).
        pythons: Python versions (``3.12``) whose backend stub the bundle holds; the first is copied into
            ``backends/python`` (the GPU machine's), every one under ``stubs/``.

    Returns:
        dict: files, unpacked_bytes, bundle_bytes, libraries (names), pythons.

    Raises:
        FileNotFoundError: nvidia-pytriton is missing, or has no stub for a version asked for.
    """
    root = pytriton_root()
    server = root / "tritonserver"
    libs = root.parent / "nvidia_pytriton.libs"
    for v in pythons:
        if not (server / "python_backend_stubs" / v / "triton_python_backend_stub").is_file():
            raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {v}")
    binaries = [server / "bin" / "tritonserver", server / "backends" / "python" / "libtriton_python.so",
                *sorted((server / "caches").rglob("*.so"))]
    needed = linked_libraries(binaries, libs)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(tmp) / "tritonserver"
        for sub in ("bin", "caches"):
            shutil.copytree(server / sub, top / sub)
        shutil.copytree(server / "backends", top / "backends", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(server / "python_backend_stubs" / pythons[0] / "triton_python_backend_stub",
                     top / "backends" / "python")
        for v in pythons:
            (top / "stubs" / v).mkdir(parents=True)
            shutil.copy2(server / "python_backend_stubs" / v / "triton_python_backend_stub", top / "stubs" / v)
        (top / "lib").mkdir()
        for lib in needed:
            shutil.copy2(lib, top / "lib")
        (top / "bundle.json").write_text(json.dumps({"pythons": pythons, "tritonserver": "2.51.0 (nvidia-pytriton "
                                                                                        "0.7.0)"}))
        files = [p for p in top.rglob("*") if p.is_file()]
        unpacked = sum(p.stat().st_size for p in files)
        bundle = output / BUNDLE_NAME
        partial = bundle.with_suffix(".part")
        with tarfile.open(partial, "w:xz", preset=6) as tar:
            tar.add(top, arcname="tritonserver")
        partial.replace(bundle)
    site = output / "site"
    shutil.rmtree(site, ignore_errors=True)
    for name in SITE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{name} is not installed: run make setup")
        shutil.copytree(list(spec.submodule_search_locations)[0], site / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return {"files": len(files), "unpacked_bytes": unpacked, "bundle_bytes": bundle.stat().st_size,
            "libraries": [p.name for p in needed], "pythons": pythons}


def unpack(bundle: Path, dest: Path) -> Path:
    """Unpack ``bundle`` (a :func:`build` tar) under ``dest``, with the stub of this interpreter's Python version in
    ``backends/python`` when the bundle has one.

    Returns:
        The server folder (``dest/tritonserver``: ``bin``, ``backends``, ``caches``, ``lib``), for
        ``SPEC_DECODE_TRITONSERVER_DIR``.

    Raises:
        FileNotFoundError: ``bundle`` does not exist.
        lzma.LZMAError, tarfile.TarError: it is not a whole bundle.
    """
    if not bundle.is_file():
        raise FileNotFoundError(f"{bundle}: no tritonserver bundle (python -m bench.gpu_day.bundle builds one)")
    with tarfile.open(bundle, "r:xz") as tar:
        tar.extractall(dest, filter="tar")
    top = dest / "tritonserver"
    stub = top / "stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
    if stub.is_file():
        shutil.copy2(stub, top / "backends" / "python" / stub.name)
    return top


def main(argv: list[str] | None = None) -> int:
    """Build the bundle and print its sizes (JSON)."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_day.bundle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", nargs="+", default=["3.12", f"{sys.version_info.major}.{sys.version_info.minor}"],
                    help="Python versions whose backend stub it holds; the first is the GPU machine's (3.12)")
    ap.add_argument("--output", type=Path, default=ROOT / "build" / "gpu_day")
    args = ap.parse_args(argv)
    info = build(args.output, list(dict.fromkeys(args.python)))
    from .served import save_tokenizer

    info["tokenizer"] = str(save_tokenizer(args.output / "tokenizer"))
    (args.output / "bundle.json").write_text(json.dumps(info, indent=2))
    print(json.dumps({k: v for k, v in info.items() if k != "libraries"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
