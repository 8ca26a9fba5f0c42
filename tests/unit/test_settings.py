"""spec_decode.settings: typed settings from config.pbtxt, one default per parameter (config.pbtxt and
docs/configuration.md agree with it), errors that name the parameter."""

import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

from spec_decode.launcher import DEFAULT_REPOSITORY
from spec_decode.proposers.registry import PROPOSERS, config_parameters
from spec_decode.settings import (
    DraftModelSettings,
    GenerateSettings,
    InvalidInputError,
    TargetSettings,
    in_range,
    one_of,
    warn_unknown_parameters,
)
from spec_decode.verifier import VerifierSettings

CONFIGURATION_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
_PARAM = re.compile(r'parameters: \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}')


def _settings_of(model: str) -> list:
    """The settings classes whose parameters a model's config.pbtxt holds."""
    return {"target_model": [TargetSettings], "verifier": [VerifierSettings], "generate": [GenerateSettings],
            "draft_model": [DraftModelSettings, *(cls.Settings for cls in PROPOSERS.values())]}[model]


def _defaults(model: str) -> dict[str, object]:
    out = {}
    for cls in _settings_of(model):
        for f in fields(cls):
            out[cls.PREFIX + f.name] = f.default
    return out


def _same(value: str, default) -> bool:
    if isinstance(default, bool):
        return value.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        return float(value) == float(default)
    return value == default


def test_from_params_converts_types_and_names_bad_values():
    s = VerifierSettings.from_params({"typical_epsilon": "0.5", "num_threads": " 3 ", "backend": " Torch "})
    assert (s.typical_epsilon, s.num_threads, s.backend) == (0.5, 3, "torch")  # choices stripped and lower-cased
    assert VerifierSettings.from_params({"num_threads": " "}).num_threads == 1  # empty: the default
    with pytest.raises(ValueError, match="config parameter 'num_threads': expected int, got 'x'"):
        VerifierSettings.from_params({"num_threads": "x"})
    with pytest.raises(ValueError, match="config parameter 'acceptance_method': 'maybe' is not one of rejection"):
        VerifierSettings.from_params({"acceptance_method": "maybe"})
    with pytest.raises(ValueError, match=r"config parameter 'typical_alpha': allowed values are finite numbers"):
        VerifierSettings.from_params({"typical_alpha": "-1"})
    # a value that is not a number also names what is allowed, where the setting has a range
    from spec_decode.proposers import DraftLMSettings
    from spec_decode.proposers.speculators import SpeculatorSettings

    with pytest.raises(ValueError, match=r"'tree_top_k': expected int, got 'abc'; must be in \[1, 10\]$"):
        SpeculatorSettings.from_params({"tree_top_k": "abc"})
    with pytest.raises(ValueError, match=r"'draft_branch_prob': expected float, got 'x'; must be in \[0.0, 1.0\]"):
        DraftLMSettings.from_params({"draft_branch_prob": "x"})


def test_a_string_setting_keeps_an_empty_value_and_numbers_are_range_checked():
    from spec_decode.proposers import DraftLMSettings, NgramSettings, SuffixSettings

    assert DraftLMSettings.from_params({"draft_model_path": ""}).draft_model_path == ""  # "" = no draft LM
    assert DraftLMSettings.from_params({}).draft_model_path == "auto"
    for cls, params, key in ((NgramSettings, {"ngram_min": "0"}, "ngram_min"),
                             (NgramSettings, {"ngram_min": "3", "ngram_max": "2"}, "ngram_max"),
                             (SuffixSettings, {"suffix_min_token_prob": "1.5"}, "suffix_min_token_prob"),
                             (SuffixSettings, {"suffix_backend": "rust"}, "suffix_backend"),
                             (TargetSettings, {"dtype": "float8"}, "dtype"),
                             (TargetSettings, {"device": "tpu"}, "device"),
                             (TargetSettings, {"max_sequences": "0"}, "max_sequences"),
                             (GenerateSettings, {"num_draft_tokens": "9"}, "num_draft_tokens"),
                             (GenerateSettings, {"num_draft_tokens_schedule": "fast"}, "num_draft_tokens_schedule"),
                             (GenerateSettings, {"step_round_max_wait_ms": "0"}, "step_round_max_wait_ms"),
                             (DraftModelSettings, {"max_num_draft_tokens": "0"}, "max_num_draft_tokens")):
        with pytest.raises(ValueError, match=f"config parameter '{key}'"):
            cls.from_params(params)


def test_rules_name_the_field_and_what_is_allowed():
    with pytest.raises(InvalidInputError, match=r"invalid input 'k': must be in \[0, 8\], got 9") as e:
        in_range("k", 9, 0, 8)
    assert e.value.field == "k" and e.value.detail == "must be in [0, 8], got 9"
    with pytest.raises(InvalidInputError, match="got nan"):
        in_range("temperature", float("nan"), 0.0, 100.0)
    assert one_of("method", " NGram ", ("none", "ngram")) == "ngram"
    with pytest.raises(InvalidInputError, match="'magic' is not one of none, ngram"):
        one_of("method", "magic", ("none", "ngram"))


@pytest.mark.parametrize("model", ["target_model", "draft_model", "verifier", "generate"])
def test_shipped_config_parameters_are_settings_at_their_defaults(model):
    """config.pbtxt lists each setting at the one default the code has (the Python backend's own upper-case keys
    aside), so the file and the code cannot drift apart."""
    params = dict(_PARAM.findall((DEFAULT_REPOSITORY / model / "config.pbtxt").read_text()))
    defaults = _defaults(model)
    for key, value in params.items():
        if key.isupper():
            continue
        assert key in defaults, f"{model}/config.pbtxt: {key} is not a setting"
        assert _same(value, defaults[key]), f"{model}/config.pbtxt: {key}={value!r}, the default is {defaults[key]!r}"
    assert set(defaults) <= set(params), f"{model}/config.pbtxt lacks {sorted(set(defaults) - set(params))}"


def test_configuration_doc_table_gives_the_defaults_of_the_settings():
    text = CONFIGURATION_DOC.read_text()
    table = text[text.index("| model | parameter | default | meaning |"):]
    table = table[: table.index("\n\n")]
    seen = set()
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        models = re.findall(r"`(\w+)`", cells[0])
        keys = re.findall(r"`(\w+)`", cells[1])
        values = [v.strip().strip("`").strip('"') for v in cells[2].split(",")]
        assert len(values) == len(keys), line
        for model in models:
            defaults = _defaults(model)
            for key, value in zip(keys, values):
                assert key in defaults, f"docs/configuration.md: {model} has no setting {key}"
                assert _same(value, defaults[key]), f"docs/configuration.md: {model} {key} = {value!r}, the default " \
                                                    f"is {defaults[key]!r}"
                seen.add((model, key))
    for model in ("target_model", "draft_model", "verifier", "generate"):
        missing = {k for k in _defaults(model) if (model, k) not in seen}
        assert not missing, f"docs/configuration.md's table lacks {model}: {sorted(missing)}"


def test_an_unknown_parameter_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="spec_decode.settings"):
        warn_unknown_parameters("draft_model", {"ngram_mx": "3", "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
                                                "ngram_max": "3"}, config_parameters())
    assert "'ngram_mx' is not a setting" in caplog.text and "FORCE_CPU" not in caplog.text
    assert "'ngram_max'" not in caplog.text.split("known")[0]
