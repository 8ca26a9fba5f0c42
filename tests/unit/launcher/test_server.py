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


def test_the_banner_names_the_methods_and_heads_the_repository_offers(tiny_heads, tmp_path):
    """served_methods reads draft_model's and generate's parameters as generate does: the draft LM when forced on, a
    head of speculator_path as its layout's method (none for a folder that holds none); served_speculators lists the
    heads' folders."""
    from spec_decode.launcher import served_methods
    from spec_decode.launcher.repository import served_speculators

    with_draft = prepare_repository({**draft_overrides("default"), "draft_model": {"draft_model_path": "default",
                                                                                   "speculator_path": ""}})
    assert served_methods(with_draft) == "none, draft, ngram, suffix, hybrid, auto"
    assert served_speculators(with_draft) == ""
    heads = prepare_repository({"draft_model": {"speculator_path": f"{tiny_heads['eagle3']},{tiny_heads['eagle']}",
                                                "draft_model_path": ""}})
    assert served_methods(heads) == "none, ngram, suffix, eagle, eagle3, hybrid, auto"
    lines = served_speculators(heads).splitlines()
    assert [line.split()[:2] for line in lines] == [["eagle3", str(tiny_heads["eagle3"])],
                                                    ["eagle", str(tiny_heads["eagle"])]]
    # each head's line names its published variant
    assert lines[0].endswith("(EAGLE-3, the EAGLE authors' layout, layer ids [0, 1, 1])"), lines[0]
    assert lines[1].endswith("(EAGLE-1, the EAGLE authors' layout)"), lines[1]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")  # no layout: not offered, and the banner says why
    bad = prepare_repository({"draft_model": {"speculator_path": str(empty), "draft_model_path": ""}})
    assert served_methods(bad) == "none, ngram, suffix, hybrid, auto"
    assert "speculators: ?" in served_speculators(bad) and "architectures" in served_speculators(bad)
    assert served_methods(tmp_path) == "?"


def test_speculator_flags_and_the_speculators_variable_serve_heads_beside_the_trained_one(monkeypatch, tmp_path,
                                                                                         capsys):
    """--speculator PATH (repeatable) and SPECULATORS=PATH[:PATH...] become draft_model's speculator_path "auto,..."
    (absolute folders); without them the repository's own value stays."""
    import spec_decode.launcher.__main__ as launcher

    class Prepared(Exception):
        pass

    seen = []

    def prepare(overrides, src):
        seen.append(overrides)
        raise Prepared

    monkeypatch.delenv("DTYPE", raising=False)  # tests/conftest.py sets it for the servers the suite starts
    monkeypatch.setattr(launcher, "prepare_default_model", lambda: None)
    monkeypatch.setattr(launcher, "prepare_repository", prepare)
    monkeypatch.setattr(launcher, "port_problems", lambda ports, host: [])  # the default ports may be taken here
    checked = []  # empty folders stand for heads: what check_heads_fit was asked (test_preflight.py checks it)
    monkeypatch.setattr(launcher, "check_heads_fit", lambda path, target: checked.append((path, target)))
    monkeypatch.setattr(launcher.signal, "signal", lambda *a: None)  # main's SIGTERM handler stays out of pytest
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("SPECULATORS", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    with pytest.raises(Prepared):
        launcher.main(["--speculator", "c"])
    assert seen[-1]["draft_model"]["speculator_path"] == f"auto,{tmp_path / 'a'},{tmp_path / 'b'},{tmp_path / 'c'}"
    assert checked == [(seen[-1]["draft_model"]["speculator_path"], launcher.default_model_dir())]
    monkeypatch.delenv("SPECULATORS")
    with pytest.raises(Prepared):
        launcher.main([])
    assert "draft_model" not in seen[-1]
    # a folder that does not exist is refused before tritonserver starts, naming it
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["--speculator", "c", "--speculator", "nope"])
    assert exit_.value.code == 2 and len(seen) == 2
    assert f"not a folder: {tmp_path / 'nope'}" in capsys.readouterr().err


def test_the_dtype_variable_reaches_the_target_and_the_draft(monkeypatch, tmp_path):
    """DTYPE=... (like --dtype) sets target_model's and draft_model's dtype in every repository prepared, unless the
    overrides name one; a value outside auto, float32, bfloat16, float16 is refused naming DTYPE."""
    monkeypatch.setenv("DTYPE", "bfloat16")
    repo = prepare_repository({"target_model": {"dtype": "float32"}})
    assert 'key: "dtype" value: { string_value: "float32" }' in (repo / "target_model" / "config.pbtxt").read_text()
    assert 'key: "dtype" value: { string_value: "bfloat16" }' in (repo / "draft_model" / "config.pbtxt").read_text()
    repo = prepare_repository()
    assert 'key: "dtype" value: { string_value: "bfloat16" }' in (repo / "target_model" / "config.pbtxt").read_text()
    monkeypatch.setenv("DTYPE", "float64")
    with pytest.raises(ValueError, match="DTYPE 'float64': one of auto, float32, bfloat16, float16"):
        prepare_repository()
    monkeypatch.delenv("DTYPE")
    from spec_decode.launcher.repository import DEFAULT_REPOSITORY

    assert prepare_repository() == DEFAULT_REPOSITORY  # nothing to override: the repository itself


def test_the_banner_says_which_dtype_auto_serves_and_why(tmp_path):
    from spec_decode.launcher.repository import DEFAULT_REPOSITORY, served_dtype

    line = served_dtype(DEFAULT_REPOSITORY)
    assert line.startswith(("float32 (auto: ", "bfloat16 (auto: ")), line
    repo = prepare_repository({"target_model": {"dtype": "float32"}})
    assert served_dtype(repo) == "float32 (asked for)"
    assert served_dtype(tmp_path) == "?"
