"""The launcher's ``--model``: a folder or a Hugging Face id resolved offline from the local hub cache in its real
layout (spec_decode.engine.model_loading.hub_snapshot), the targets the engine refuses (check_servable), and the config
overrides one flag makes (spec_decode.launcher.repository.model_overrides)."""

import json

import pytest

from spec_decode.engine.model_loading import check_servable, hub_cache_dir, is_hub_id, resolve_model_path
from spec_decode.launcher.repository import model_overrides, prepare_repository
from tests.hf_cache import write_hub_model, write_tiny_target


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, real_model_dir):
    return write_tiny_target(tmp_path_factory.mktemp("tiny") / "tiny-llama", real_model_dir)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty local hub cache that huggingface_hub and the launcher read (HF_HUB_CACHE)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_id_resolves_offline_from_the_local_cache(cache, tiny_folder, tmp_path, monkeypatch):
    snapshot = write_hub_model(cache, "acme/tiny-llama", tiny_folder)
    assert hub_cache_dir() == cache and is_hub_id("acme/tiny-llama") and not is_hub_id(str(tiny_folder))
    assert resolve_model_path("acme/tiny-llama") == snapshot
    assert (snapshot / "config.json").is_symlink()  # the real layout: snapshots link into blobs
    # HF_HOME/hub when HF_HUB_CACHE is unset
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    write_hub_model(tmp_path / "home" / "hub", "acme/other", tiny_folder)
    assert resolve_model_path("acme/other").parent.parent.name == "models--acme--other"


def test_an_id_not_in_the_cache_is_refused_naming_where_it_looked_and_the_download_command(cache):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("acme/missing")
    msg = str(e.value)
    assert str(cache / "models--acme--missing") in msg and "hf download acme/missing" in msg
    assert "never downloads" in msg
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("/no/such/folder")


def test_model_overrides_set_the_target_the_tokenizers_and_the_name(cache, tiny_folder):
    snapshot = write_hub_model(cache, "acme/tiny-llama", tiny_folder)
    overrides, folder, name = model_overrides("acme/tiny-llama", "float32", "cpu", 256, 4096)
    assert folder == snapshot and name == "tiny-llama"
    assert overrides["target_model"] == {"model_path": str(snapshot), "dtype": "float32", "device": "cpu",
                                         "kv_cache_max_tokens": "4096"}
    assert overrides["generate"] == {"tokenizer_path": str(snapshot), "max_model_len": "256"}
    assert overrides["draft_model"] == {"tokenizer_path": str(snapshot), "draft_model_path": "", "speculator_path": "",
                                        "dtype": "float32", "device": "cpu"}
    repo = prepare_repository(overrides)  # every key is a parameter the configs have
    assert f'string_value: "{snapshot}"' in (repo / "target_model" / "config.pbtxt").read_text()
    _, folder, name = model_overrides(str(tiny_folder))  # a folder: its own name
    assert folder == tiny_folder and name == "tiny-llama"


@pytest.mark.parametrize("args, match", [
    (dict(max_model_len=1024), "max_model_len 1024 is above the model's max_position_embeddings 512"),
    (dict(dtype="float64"), "--dtype / DTYPE 'float64': one of auto, float32, bfloat16, float16"),
    (dict(device="tpu"), "--device 'tpu': one of auto, cpu, cuda"),
    (dict(max_model_len=1), "--max-model-len 1: at least 2"),
    (dict(kv_cache_max_tokens=8), "--kv-cache-max-tokens 8: at least 1024"),
    (dict(kv_cache_max_tokens=1023), "--kv-cache-max-tokens 1023: at least 1024 (target_model's smallest KV pool)"),
])
def test_bad_values_are_refused_naming_the_flag(tiny_folder, args, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        model_overrides(str(tiny_folder), **args)


@pytest.mark.parametrize("edit, key", [
    ({"sliding_window": 64, "use_sliding_window": True}, "'sliding_window'"),
    ({"sliding_window": 64}, "'sliding_window'"),  # Mistral's: a window without use_sliding_window
    ({"layer_types": ["sliding_attention", "full_attention"]}, "'layer_types'"),
    ({"architectures": ["BertModel"]}, "'architectures'"),
    ({"is_encoder_decoder": True}, "'is_encoder_decoder'"),
])
def test_an_architecture_the_engine_cannot_serve_is_refused_naming_why(tiny_folder, tmp_path, edit, key):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edit)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key):
        check_servable(folder)
    with pytest.raises(ValueError, match=key):  # the target's load fails the same way, naming the parameter
        from spec_decode.serving.target_model import TargetBackend

        TargetBackend({"model_path": str(folder), "device": "cpu"})


def test_a_qwen2_config_with_its_window_off_is_served(tiny_folder, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(sliding_window=4096, use_sliding_window=False)  # how Qwen2 configs ship
    (folder / "config.json").write_text(json.dumps(cfg))
    assert check_servable(folder)["sliding_window"] == 4096


def test_a_tokenizer_without_an_end_of_sequence_id_is_refused(tiny_folder, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg.pop("eos_token_id", None)
            cfg.pop("eos_token", None)
            path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'eos_token_id'"):
        check_servable(folder)
