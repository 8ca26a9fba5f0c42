"""The docs' statements that the code decides: docs/client.md's client contract (every input and output of generate
with its wire type, the shipped defaults, every registered method), and every relative link of the docs resolving."""

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
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"
