"""spec_decode.launcher: the repository overrides the launcher writes (config.pbtxt parameters)."""

import pytest

from spec_decode.launcher import draft_overrides, prepare_repository


def test_prepare_repository_overrides_parameters():
    repo = prepare_repository(draft_overrides("/some/folder"))
    assert 'string_value: "/some/folder"' in (repo / "draft_model" / "config.pbtxt").read_text()
    assert ('key: "draft_model_available" value: { string_value: "true" }'
            in (repo / "generate" / "config.pbtxt").read_text())


def test_unknown_parameter_is_an_error():
    with pytest.raises(KeyError, match="no_such_key"):
        prepare_repository({"draft_model": {"no_such_key": "1"}})


def test_the_banner_names_the_methods_the_repository_offers(tmp_path):
    """served_methods reads draft_model's and generate's parameters as generate does: the draft LM when forced on, the
    EAGLE head only when its folder holds one."""
    from spec_decode.launcher import served_methods

    head = tmp_path / "head"
    head.mkdir()
    with_draft = prepare_repository({**draft_overrides("default"), "draft_model": {"draft_model_path": "default",
                                                                                   "eagle_path": ""}})
    assert served_methods(with_draft) == "none, draft, ngram, suffix, hybrid"
    (head / "config.json").write_text("{}")
    assert served_methods(prepare_repository({"draft_model": {"eagle_path": str(head), "draft_model_path": ""}})) \
        == "none, ngram, suffix, eagle, hybrid"
    assert served_methods(tmp_path) == "?"
