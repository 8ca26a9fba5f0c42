"""Repository overrides used by the launcher (config.pbtxt parameters)."""

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


def test_config_param_converts_and_names_bad_values():
    from spec_decode.serving.adapter import config_param

    params = {"k": "6", "eps": "0.5", "empty": " ", "bad": "x"}
    assert config_param(params, "k", 4) == 6 and config_param(params, "eps", 0.09) == 0.5
    assert config_param(params, "empty", 3) == 3 and config_param(params, "missing", 1.5) == 1.5
    with pytest.raises(ValueError, match="'bad'"):
        config_param(params, "bad", 2)
