"""spec_decode.server: the repository overrides the launcher writes (config.pbtxt parameters)."""

import pytest

from spec_decode.server import draft_overrides, prepare_repository


def test_prepare_repository_overrides_parameters():
    repo = prepare_repository(draft_overrides("/some/folder"))
    assert 'string_value: "/some/folder"' in (repo / "draft_model" / "config.pbtxt").read_text()
    assert ('key: "draft_model_available" value: { string_value: "true" }'
            in (repo / "generate" / "config.pbtxt").read_text())


def test_unknown_parameter_is_an_error():
    with pytest.raises(KeyError, match="no_such_key"):
        prepare_repository({"draft_model": {"no_such_key": "1"}})
