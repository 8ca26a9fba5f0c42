"""The docs' statements that the code decides: docs/client.md's client contract (every input and output of generate
with its wire type, the shipped defaults, every registered method), and, in README.md, CONTRIBUTING.md and docs/*.md,
every relative link resolving (its ``#anchor`` too: a heading of the target under GitHub's slug rules), every
``make TARGET`` being a Makefile target, every ``python -m MODULE`` an existing module, and every launcher flag and
``VAR=value`` before ``make`` or the launcher one that the launcher or the Makefile reads. Nothing is run: the Makefile
and the launcher's argparse calls are read as text."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from spec_decode.proposers.registry import METHODS
from spec_decode.serving import wire
from spec_decode.settings import GenerateSettings

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DOC = ROOT / "docs" / "client.md"
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _contract_rows() -> dict[str, list[str]]:
    """The rows of the "Client contract" tables of docs/client.md: tensor name -> the cells after it (a row that
    names several tensors gives each of them)."""
    text = CLIENT_DOC.read_text()
    section = text[text.index("## Client contract"):text.index("### Errors")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[name] = cells[1:]
    return rows


def test_every_input_and_output_of_generate_is_documented_with_its_wire_type():
    rows = _contract_rows()
    model = wire.MODELS["generate"]
    assert set(rows) == set(model.input_names) | set(model.output_names)
    for tensor in (*model.inputs, *model.outputs):
        dims = ", ".join(str(d) for d in tensor.dims)
        assert rows[tensor.name][0] == f"{tensor.dtype} [{dims}]", tensor.name


def test_documented_defaults_are_the_shipped_ones_and_every_method_is_listed():
    rows, s = _contract_rows(), GenerateSettings()
    assert rows["num_draft_tokens"][1] == str(s.num_draft_tokens)
    assert f"({s.max_num_draft_tokens})" in rows["num_draft_tokens"][2]
    assert rows["speculative_method"][1] == f"`{s.default_speculative_method}`"
    listed = set(re.findall(r"`(\w+)`", rows["speculative_method"][2]))
    assert set(METHODS) <= listed, f"docs/client.md does not describe {sorted(set(METHODS) - listed)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text, bad = doc.read_text(), []
    for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        target = m.group(1)
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (doc.parent / target).exists():
            bad.append(f"{_where(doc, _line_of(text, m.start()))}: links to {target}, which does not exist")
    assert not bad, "\n".join(bad)


# The docs' commands and links against the repository: relative links and their anchors, `make` targets, `python -m`
# modules, the launcher's flags and the environment variables shown before `make` or the launcher.

FENCE = re.compile(r"^\s*(```|~~~)")
MAKEFILE = ROOT / "Makefile"
LAUNCHER = ROOT / "backend_src" / "spec_decode" / "launcher"
# Environment variables the docs may show without this repository reading them: read by the tools underneath
# (Hugging Face's cache, CUDA, Python itself, OpenMP/torch, Triton's interpreter).
WELL_KNOWN_ENV = {"HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "OMP_NUM_THREADS",
                  "TRITON_INTERPRET"}
# Modules run with `python -m` that are not in this repository: checked with importlib.util.find_spec (top level only,
# so nothing is imported) unless listed here.
WELL_KNOWN_MODULES = {"pytest", "pip", "venv"}


def _lines(doc: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a fenced code block) for each line of ``doc``; fence lines count as code."""
    out, fenced = [], False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            out.append((n, line, True))
            fenced = not fenced
            continue
        out.append((n, line, fenced))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: markdown links and code marks dropped, lower case, punctuation other than
    ``-`` and ``_`` removed, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    """The anchors of every heading of ``doc`` (outside code blocks); a repeated slug gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out = set()
    for _, line, code in _lines(doc):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if code or not m:
            continue
        slug = _slug(m.group(1))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _prose(doc: Path) -> str:
    """``doc`` with its fenced code blocks blanked (line numbers kept)."""
    return "\n".join("" if code else line for _, line, code in _lines(doc))


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _commands(doc: Path) -> list[tuple[int, str]]:
    """(line, command) of every shell command ``doc`` shows: each logical line of its fenced code blocks (continuations
    with a trailing backslash joined) and each inline code span of its prose (across line breaks), cut at ``;``,
    ``&&``, ``|`` and comments (a comment's own commands count too)."""
    texts: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, line, code in _lines(doc):
        if not code or FENCE.match(line):
            continue
        start, text = pending if pending else (n, "")
        text += " " + line.strip()
        if text.endswith("\\"):
            pending = (start, text[:-1])
            continue
        pending = None
        texts.append((start, text))
    prose = _prose(doc)
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose, re.S):
        texts.append((_line_of(prose, m.start()), m.group(2)))
    return [(n, " ".join(part.split())) for n, text in texts for part in re.split(r"\s#(?:\s|$)|&&|\|\||[;|]", text)]


def _paragraphs(doc: Path) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph or list item of ``doc``'s prose."""
    out: list[tuple[int, str]] = []
    for n, line, code in _lines(doc):
        item = re.match(r"^\s*(?:[-*]|\d+\.)\s", line)
        if code or not line.strip() or item or not out or out[-1][1] == "":
            out.append((n, "" if code or not line.strip() else line))
        else:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
    return [p for p in out if p[1]]


def _where(doc: Path, line: int) -> str:
    return f"{doc.relative_to(ROOT)}:{line}"


def _make_targets() -> set[str]:
    text = MAKEFILE.read_text()
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9_.\- ]+?)\s*::?(?!=)", text, re.M):
        targets.update(t for t in m.group(1).split() if not t.startswith("."))
    for m in re.finditer(r"^\.PHONY:(.*)$", text, re.M):
        targets.update(m.group(1).split())
    return targets


def _launcher_flags() -> set[str]:
    """The option strings of every ``add_argument`` call in the launcher's modules (read with ``ast``: nothing runs)."""
    flags = set()
    for path in LAUNCHER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-"))
    return flags | {"-h", "--help"}


def _env_read() -> set[str]:
    """The environment variables the Makefile, the scripts it runs and the Python code of the repository read."""
    names = set(WELL_KNOWN_ENV)
    make = MAKEFILE.read_text()
    names.update(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*\?=", make, re.M))
    for m in re.finditer(r"^export\s+(.*)$", make, re.M):
        names.update(re.findall(r"\b[A-Z_][A-Z0-9_]*\b", m.group(1)))
    for path in (ROOT / "scripts").glob("*.sh"):
        names.update(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):?[-=]", path.read_text()))
    read = re.compile(r"""(?:environ\.get|environ\.setdefault|getenv|environ\[)\(?\s*["']([A-Z_][A-Z0-9_]*)["']""")
    for folder in ("backend_src", "client", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(read.findall(path.read_text()))
    return names


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` runs: a module of the repository, or a package of it with a ``__main__``, or an
    installed top-level module."""
    rel = Path(*name.split("."))
    for base in (ROOT, ROOT / "backend_src"):
        if (base / rel).with_suffix(".py").is_file() or (base / rel / "__main__.py").is_file():
            return True
    if name in WELL_KNOWN_MODULES:
        return True
    return "." not in name and importlib.util.find_spec(name) is not None


ASSIGNMENTS = r"""((?:[A-Z_][A-Z0-9_]*=(?:"[^"]*"|'[^']*'|[^\s;|&])*\s+)*)"""
MAKE = re.compile(r"(?:^|[\s(])" + ASSIGNMENTS + r"make((?:\s+[^\s)]+)+)")
PYTHON_M = re.compile(r"(?:^|[\s(])" + ASSIGNMENTS
                      + r"(?:\S*/)?(?:python3?|\$\(PY\))(?:\s+-[A-Za-z]\S*)*\s+-m\s+([\w.]+)(.*)")


def _assigned(prefix: str) -> list[str]:
    return re.findall(r"([A-Z_][A-Z0-9_]*)=", prefix)


def _ports(assigned: dict[str, str], flags: dict[str, str]) -> dict[str, str]:
    """The four ports a server started with these ``VAR=value`` assignments and launcher flags listens on (the
    Makefile's defaults otherwise)."""
    defaults = dict(re.findall(r"^(\w+_PORT)\s*\?=\s*(\S+)", MAKEFILE.read_text(), re.M))
    return {var: flags.get("--" + var[:-len("_PORT")].lower() + "-port", assigned.get(var, default))
            for var, default in defaults.items()}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_link_anchors_resolve(doc):
    """Every ``file.md#heading`` and ``#heading`` link names a heading of its target under GitHub's slug rules."""
    prose, bad = _prose(doc), []
    for m in re.finditer(r"\]\(([^)\s#]*)#([^)\s]+)\)", prose):
        target, anchor = m.groups()
        if "://" in target:
            continue
        path = (doc.parent / target) if target else doc
        if path.suffix == ".md" and path.is_file() and anchor not in _anchors(path):
            bad.append(f"{_where(doc, _line_of(prose, m.start()))}: #{anchor} is no heading of {path.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_make_targets_exist(doc):
    """Every ``make TARGET`` the doc shows (code blocks and inline code) is a target of the Makefile."""
    targets, bad = _make_targets(), []
    for line, cmd in _commands(doc):
        for m in MAKE.finditer(cmd):
            named = [w for w in m.group(2).split() if not w.startswith("-") and "=" not in w]
            bad += [f"{_where(doc, line)}: `make {t}`: no such Makefile target" for t in named if t not in targets]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_modules_exist(doc):
    """Every ``python -m MODULE`` the doc shows names a module of the repository or an installed one."""
    bad = [f"{_where(doc, line)}: `python -m {m.group(2)}`: no such module" for line, cmd in _commands(doc)
           for m in PYTHON_M.finditer(cmd) if not _module_exists(m.group(2))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_launcher_flags_and_environment_variables_exist(doc):
    """Every flag the doc shows for ``python -m spec_decode.launcher`` (and on a ``make serve`` line) is one the
    launcher's argparse accepts, and so is every flag in inline code of a paragraph about the launcher ("Its options:
    `--http-port`, ..."); every ``VAR=value`` before ``make`` or the launcher (or ``make VAR=value``) is read by the
    Makefile, the scripts it runs or the code (or is a well-known one); and the four ports of such a server differ."""
    flags, env, bad = _launcher_flags(), _env_read(), []
    for line, cmd in _commands(doc):
        where, serving = _where(doc, line), []
        for m in MAKE.finditer(cmd):
            words = m.group(2).split()
            assigned = m.group(1).split() + [w for w in words if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w)]
            named = [w for w in words if not w.startswith("-") and "=" not in w]
            shown = re.findall(r"(?<!\S)--?[\w-]+", m.group(2)) if named[:1] == ["serve"] else []
            serving += [(assigned, [])] if named[:1] == ["serve"] else []
            bad += [f"{where}: `{v}=` is read by neither the Makefile nor the code"
                    for v in _assigned(" ".join(assigned)) if v not in env]
            bad += [f"{where}: `{f}`: not a flag of spec_decode.launcher" for f in shown if f not in flags]
        for m in PYTHON_M.finditer(cmd):
            if m.group(2) != "spec_decode.launcher":
                continue
            shown = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)(?:[ =]([^\s-]\S*))?", m.group(3))
            serving.append((m.group(1).split(), shown))
            bad += [f"{where}: `{v}=` is read by neither the Makefile nor the code" for v in _assigned(m.group(1))
                    if v not in env]
            bad += [f"{where}: `{f}`: not a flag of spec_decode.launcher" for f, _ in shown if f not in flags]
        for assigned, shown in serving:
            ports = _ports(dict(a.split("=", 1) for a in assigned), dict(shown))
            if "--no-openai" in dict(shown):  # the frontend's port is not listened on
                ports.pop("OPENAI_PORT", None)
            clash = {p: [v for v in ports if ports[v] == p] for p in ports.values()}
            bad += [f"{where}: {' and '.join(vs)} are both {p}: the server cannot listen on both"
                    for p, vs in clash.items() if len(vs) > 1]
    for line, text in _paragraphs(doc):
        if re.search(r"spec_decode\.launcher|launcher's (?:other )?options", text):
            for m in re.finditer(r"`(--[\w-]+)[ =`]", text):
                if m.group(1) not in flags:
                    bad.append(f"{_where(doc, line + text.count(chr(10), 0, m.start()))}: `{m.group(1)}`: not a flag "
                               f"of spec_decode.launcher")
    assert not bad, "\n".join(bad)
