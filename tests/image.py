"""The Docker image as far as it can be checked without a Docker daemon: the Dockerfile's instructions, the published
versions of its NGC base image, and what pip resolves for that image's Python and platform.

``pip install --dry-run --report`` with ``--python-version``, ``--platform`` and ``--only-binary=:all:`` resolves a
set of requirements for another interpreter and glibc without installing anything (pip's documentation, "pip
install", options for a target environment); pip expands no platform tag by itself, so every ``manylinux`` tag the
image's glibc accepts is passed (PEP 600: ``manylinux_2_{5..N}``, and the legacy ``manylinux1`` / ``2010`` / ``2014``
aliases). The machine's own pip configuration (its local wheel folder, a torch cap for this CPU) is left out, so the
registry answers as it would in ``docker build``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True)
class BaseImage:
    """One release of NVIDIA's ``nvcr.io/nvidia/tritonserver:<tag>-py3`` image, as its release notes describe it.

    Attributes:
        tag: the container release, ``YY.MM``.
        triton: the Triton Inference Server version inside.
        ubuntu: the Ubuntu release it is built on.
        python: the Python of that Ubuntu (``MAJOR.MINOR``), which the Python backend's stub links.
        glibc: that Ubuntu's glibc (``2.N``): the newest ``manylinux_2_N`` wheels it runs.
        cuda: the CUDA toolkit inside.
    """

    tag: str
    triton: str
    ubuntu: str
    python: str
    glibc: str
    cuda: str

    @property
    def image(self) -> str:
        """The image reference, ``nvcr.io/nvidia/tritonserver:<tag>-py3``."""
        return f"nvcr.io/nvidia/tritonserver:{self.tag}-py3"


# NGC tritonserver releases this project knows, from NVIDIA's release notes
# (docs.nvidia.com/deeplearning/triton-inference-server/release-notes/rel-YY-MM.html: "based on CUDA ...", "Ubuntu ...
# including Python ...") and, for 26.09, the triton-inference-server/server repository's build.py of that release
# (2.73.0, Ubuntu 24.04 bases). glibc is the Ubuntu release's (22.04: 2.35, 24.04: 2.39). Add a row, from the release
# notes, before moving the Dockerfile to another tag.
NGC_TRITONSERVER = {
    "24.10": BaseImage("24.10", "2.51.0", "22.04", "3.10", "2.35", "12.6.2"),
    "24.12": BaseImage("24.12", "2.53.0", "24.04", "3.12", "2.39", "12.6.3"),
    "26.09": BaseImage("26.09", "2.73.0", "24.04", "3.12", "2.39", "13.4.1"),
}


def instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined (blank and comment lines
    inside one skipped, as Docker does) and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):  # outside an instruction, or inside a continued one: skipped
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).strip().partition(" ")
        pending = ""
        out.append((word.upper(), rest.strip()))
    return out


def base_image(text: str) -> BaseImage:
    """The NGC tritonserver release the image of the Dockerfile ``text`` is (its last ``FROM``: the final stage).

    Raises:
        ValueError: the image is not ``nvcr.io/nvidia/tritonserver:<tag>-py3``, or a tag without a row in
            :data:`NGC_TRITONSERVER` (naming it).
    """
    image = [args for word, args in instructions(text) if word == "FROM"][-1].split()[0]
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", image)
    if m is None:
        raise ValueError(f"FROM {image}: not NVIDIA's tritonserver image (nvcr.io/nvidia/tritonserver:YY.MM-py3)")
    if m.group(1) not in NGC_TRITONSERVER:
        raise ValueError(f"FROM {image}: release {m.group(1)} has no row in tests/image.py NGC_TRITONSERVER (its "
                         f"Triton, Ubuntu, Python, glibc and CUDA from NVIDIA's release notes); known: "
                         f"{', '.join(NGC_TRITONSERVER)}")
    return NGC_TRITONSERVER[m.group(1)]


def copy_sources(text: str) -> list[str]:
    """The build-context paths every ``COPY`` / ``ADD`` of the Dockerfile ``text`` reads (``--from`` stages aside)."""
    sources = []
    for word, args in instructions(text):
        if word not in ("COPY", "ADD"):
            continue
        flags = re.match(r"((?:--\S+\s+)*)(.*)$", args)
        assert flags is not None
        if "--from" in flags.group(1):
            continue
        rest = flags.group(2)
        parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        sources += parts[:-1]
    return sources


@dataclass
class Installs:
    """What the image installs with pip.

    Attributes:
        files: requirement files (``-r``), resolved with their dependencies.
        with_deps: requirement strings resolved with their dependencies.
        no_deps: requirement strings installed with ``--no-deps``.
        sdists: requirement strings downloaded as source (``--no-binary :all:``) and built in the image.
        local: local paths installed (``.``: the project itself).
        unchecked: pip commands, options and settings this reading cannot account for (another index, constraints,
            pre-releases, an exec-form or heredoc ``RUN``, a pip command it does not parse): each would let the image
            install something that :func:`resolve` does not check.
    """

    files: list[str] = field(default_factory=list)
    with_deps: list[str] = field(default_factory=list)
    no_deps: list[str] = field(default_factory=list)
    sdists: list[str] = field(default_factory=list)
    local: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)


# pip run as a program (any path or version suffix) or a module, with options before its command
_PIP = re.compile(r"(?:^|\s)(?:\S*python[\d.]*\s+-m\s+pip|\S*\bpip[\d.]*|\"\$PY\"\s+-m\s+pip)"
                  r"((?:\s+-[-\w]+(?:=\S+)?)*)\s+(install|download)\b(.*)$")
_MENTIONS_PIP = re.compile(r"(?:^|[\s/\"'])pip[\d.]*(?:\s|$)")
_OPTIONS_WITH_VALUE = {"-r", "--requirement", "-d", "--dest", "-c", "--constraint", "--no-binary", "--only-binary",
                       "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--target", "-t"}
# options that make pip read another index, constraints or pre-releases: what resolve() checks would not be it
_UNCHECKED_OPTIONS = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "--pre")
_UNCHECKED_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_PRE")


def _add_pip_command(command: str, out: Installs) -> None:
    """The requirements of one shell command, when it runs pip (else nothing; an unparsed pip command: unchecked)."""
    m = _PIP.search(" " + command.strip())
    if m is None:
        if _MENTIONS_PIP.search(" " + command):
            out.unchecked.append(command.strip())
        return
    try:
        verb, words = m.group(2), shlex.split(m.group(1) + " " + m.group(3))
    except ValueError:  # quoting this reading does not follow (sh -c "pip ...")
        out.unchecked.append(command.strip())
        return
    if any(w.split("=", 1)[0] in _UNCHECKED_OPTIONS or re.fullmatch(r"-[icf]\S+", w) for w in words):
        out.unchecked.append(command.strip())
    no_deps, source = "--no-deps" in words, any(w.startswith("--no-binary") for w in words)
    i = 0
    while i < len(words):
        w = words[i]
        if w in ("-r", "--requirement"):
            out.files.append(words[i + 1])
        elif w.startswith("--requirement="):
            out.files.append(w.split("=", 1)[1])
        elif w.startswith("-r") and not w.startswith("--"):
            out.files.append(w[2:])
        if w in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        i += 1
        if w.startswith("-"):
            continue
        if w.startswith((".", "/")):
            out.local.append(w)
        elif verb == "download" and source:
            out.sdists.append(w)
        elif verb == "install":
            (out.no_deps if no_deps else out.with_deps).append(w)


def _commands(shell: str) -> list[str]:
    """A shell text's simple commands (split at ``&&``, ``||``, ``;`` and ``|``; redirections dropped)."""
    return [re.sub(r"\s\d*>.*$", "", c) for c in re.split(r"&&|\|\||;|\|", shell) if c.strip()]


_SCRIPT = re.compile(r"(?:\b(?:ba)?sh(?:\s+-\w+)*\s+|(?:^|\s))(\.?/?[\w./-]+\.sh)\b")


def _script_installs(script: Path, out: Installs) -> None:
    """The pip commands of a shell script the Dockerfile runs, with its ``NAME=value`` variables substituted."""
    text = script.read_text().replace("\\\n", " ")  # continuation lines joined
    variables = dict(re.findall(r"^([A-Z_]+)=([^\s$]+)$", text, re.M))
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        for name, value in variables.items():
            line = line.replace(f"${name}", value).replace(f"${{{name}}}", value)
        for command in _commands(line):
            _add_pip_command(command, out)


def installs(text: str, root: Path = ROOT) -> Installs:
    """Every pip install of the Dockerfile ``text``: its ``RUN`` commands (``ONBUILD RUN`` too), and those of the
    repository's shell scripts they run (``bash scripts/x.sh``, ``sh x.sh``, ``./x.sh``); what it cannot read goes to
    :attr:`Installs.unchecked`."""
    out = Installs()
    for word, args in instructions(text):
        if word == "ONBUILD":
            word, _, args = args.partition(" ")
            word = word.upper()
        if word == "ENV":
            out.unchecked += [f"ENV {v}" for v in _UNCHECKED_ENV if re.search(rf"\b{v}\b", args)]
        if word != "RUN":
            continue
        args = re.sub(r"^(--\S+\s+)*", "", args)  # RUN --mount=... and the like
        if args.startswith(("[", "<<")):  # exec form, heredoc
            if "pip" in args:
                out.unchecked.append(f"RUN {args[:80]}")
            continue
        for command in _commands(args):
            _add_pip_command(command, out)
            for script in _SCRIPT.findall(command):
                if (root / script).is_file():
                    _script_installs(root / script, out)
    return out


def manylinux_platforms(glibc: str, arch: str = "x86_64") -> list[str]:
    """Every platform tag a wheel may carry to run on glibc ``glibc`` (``2.N``), newest first (PEP 600 and the legacy
    aliases of PEP 513 / 571 / 599)."""
    minor = int(glibc.split(".")[1])
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for n, name in legacy.items() if n <= minor]


def _pip_env() -> dict[str, str]:
    """This process's environment without the machine's pip configuration (config files, local wheels, constraints),
    so that only the package registry answers; its certificate and timeout settings stay."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@dataclass
class Resolution:
    """pip's answer for a set of requirements on one image.

    Attributes:
        ok: pip resolved every requirement.
        installed: canonical project name (PEP 503) -> version pip would install (empty when not ok).
        requires: canonical project name (PEP 503) -> its ``Requires-Dist`` lines.
        errors: pip's ``ERROR:`` lines (and the lines that explain them) when not ok.
    """

    ok: bool
    installed: dict[str, str]
    requires: dict[str, list[str]]
    errors: list[str]


def target_environment(image: BaseImage) -> dict[str, str]:
    """The values of PEP 508 environment markers inside ``image`` (CPython on x86-64 Linux)."""
    return {"python_version": image.python, "python_full_version": f"{image.python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def file_requirements(path: Path, image: BaseImage | None = None) -> list[str]:
    """The requirements of a requirements file, its ``-r`` includes followed; with ``image``, those whose environment
    marker holds in the image, written without it (pip evaluates a requirement's marker against the interpreter that
    runs it, not against ``--python-version``)."""
    from packaging.requirements import Requirement

    out = []
    for raw in Path(path).read_text().splitlines():
        line = "" if raw.lstrip().startswith("#") else raw.split(" #", 1)[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            out += file_requirements(Path(path).parent / line.split(None, 1)[1], image)
        elif line and not line.startswith("-"):
            req = Requirement(line)
            if image is not None and req.marker is not None:
                if not req.marker.evaluate(target_environment(image)):
                    continue
                req.marker = None
            out.append(str(req))
    return out


def resolve(requirements: list[str], image: BaseImage, no_deps: bool = False, timeout: float = 600.0) -> Resolution:
    """Resolve ``requirements`` (strings without environment markers: :func:`file_requirements`) for ``image``'s
    Python and platform with pip's dry run, binary wheels only.

    Markers inside the packages' own metadata are evaluated by pip against the interpreter that runs this (a known
    limit of ``--python-version``); the pins here carry none that differ between Python 3.11 and 3.12.

    Raises:
        subprocess.TimeoutExpired: pip took longer than ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-color",
               "--only-binary=:all:", "--python-version", image.python, "--implementation", "cp",
               "--target", str(Path(tmp) / "target"), "--report", str(report)]
        for platform in manylinux_platforms(image.glibc):
            cmd += ["--platform", platform]
        if no_deps:
            cmd.append("--no-deps")
        proc = subprocess.run(cmd + list(requirements), capture_output=True, text=True, timeout=timeout,
                              env=_pip_env(), cwd=ROOT)
        if proc.returncode != 0 or not report.exists():
            # pip's errors (stderr) and, for a conflict, the requirements that cause it (stdout, before its hints)
            errors = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip().startswith("ERROR:")]
            out = proc.stdout.split("The conflict is caused by:", 1)
            if len(out) == 2:
                cause = out[1].split("To fix this", 1)[0]
                errors.append("The conflict is caused by: " + "; ".join(ln.strip() for ln in cause.splitlines()
                                                                        if ln.strip()))
            return Resolution(False, {}, {}, errors or [f"pip exited with {proc.returncode}"])
        data = json.loads(report.read_text())
    installed = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}
    requires = {canonicalize_name(i["metadata"]["name"]): list(i["metadata"].get("requires_dist") or [])
                for i in data["install"]}
    return Resolution(True, installed, requires, [])


def unresolvable(requirements: list[str], image: BaseImage, workers: int = 4) -> dict[str, list[str]]:
    """Each of ``requirements`` that has no distribution for ``image`` on its own (``--no-deps``), with pip's reason:
    the requirements a resolution that failed cannot take, named one by one."""
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda r: resolve([r], image, no_deps=True), requirements))
    return {r: res.errors for r, res in zip(requirements, results) if not res.ok}


def failure_message(image: BaseImage, bad: dict[str, list[str]], errors: list[str]) -> str:
    """What a failed resolution tells the reader: each requirement that does not resolve and why, with the image's
    Python and platform."""
    where = f"Python {image.python} on manylinux_2_{image.glibc.split('.')[1]}_x86_64 ({image.image})"
    if bad:
        return "; ".join(f"{req} does not resolve for {where}: {' '.join(why[-3:])}" for req, why in bad.items())
    return f"the requirements do not resolve together for {where}: {' '.join(errors[:12])}"


def sdist_on_index(requirement: str, image: BaseImage, index: str = "https://pypi.org/simple") -> str | None:
    """Why a source distribution pinned as ``name==version`` cannot be built in ``image`` (no such sdist on the index,
    or its ``Requires-Python`` excludes the image's Python), or None when it can be downloaded there. Reads the
    index's JSON page (PEP 691)."""
    import urllib.request

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import InvalidSdistFilename, parse_sdist_filename

    req = Requirement(requirement)
    version = next(iter(req.specifier)).version
    page = urllib.request.Request(f"{index}/{canonicalize_name(req.name)}/",
                                  headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(page, timeout=60) as r:
        files = json.load(r)["files"]
    sdists = []
    for f in files:
        try:
            name, found = parse_sdist_filename(f["filename"])
        except InvalidSdistFilename:  # a wheel, or another kind of file
            continue
        if canonicalize_name(name) == canonicalize_name(req.name) and str(found) == version:
            sdists.append(f)
    if not sdists:
        return f"{requirement}: no source distribution on {index}"
    spec = sdists[0].get("requires-python") or ""
    if spec and image.python + ".0" not in SpecifierSet(spec):
        return f"{requirement}: Requires-Python {spec} excludes Python {image.python} ({image.image})"
    return None
