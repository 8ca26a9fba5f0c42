"""check_heads_fit: the launcher's check, before anything starts, that every head speculator_path serves was made for
the served target. Heads of every family are written for one tiny target (hidden 32, vocabulary 97, 2 layers) and
checked against target folders holding only a config.json: of the same sizes (they pass), of other sizes (refused,
naming the head, its method, both folders and both sizes), without reading any weight data."""

import json
from pathlib import Path

import pytest
import safetensors
import torch

from spec_decode.proposers.speculators import HeadFitError, SpeculatorLoadError, check_heads_fit
from spec_decode.proposers.speculators.checkpoint import weight_names, weight_shapes
from tests.speculator_checkpoints.arctic import write_arctic
from tests.speculator_checkpoints.eagle import write_eagle1, write_eagle3
from tests.speculator_checkpoints.medusa import BASE_MODEL, write_medusa
from tests.speculator_checkpoints.mlp import write_mlp_speculator

H, V, LAYERS = 32, 97, 2  # the tiny target the heads are written for (4 heads, 2 key/value heads, MLP 64)
OTHER_H, OTHER_V = 48, 131  # another target's


def _embedding(rows=V, cols=H):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))


# name -> (method, writer of a head for the tiny target into a folder, whether it records the target's vocabulary)
HEADS = {
    "eagle1": ("eagle", lambda d: write_eagle1(d, _embedding(), 4, 2, 64)),  # pytorch_model.bin, as published
    "eagle1_vllm": ("eagle", lambda d: write_eagle1(d, _embedding(), 4, 2, 64, layout="vllm", fmt="safetensors")),
    "eagle1_vllm_truncated": ("eagle", lambda d: write_eagle1(d, _embedding(), 4, 2, 64, layout="vllm",
                                                              fmt="safetensors", token_map=torch.arange(0, V, 2))),
    "eagle3": ("eagle3", lambda d: write_eagle3(d, H, V, 4, 2, 64, 48, layer_ids=[0, 1, 1])),
    "eagle3_trainer": ("eagle3", lambda d: write_eagle3(d, H, V, 4, 2, 64, 48, layout="trainer",
                                                        fmt="safetensors", layer_ids=[0, 2, 1])),
    "eagle3_speculators_wider": ("eagle3", lambda d: write_eagle3(
        d, 48, V, 6, 2, 64, 48, layout="speculators", layer_ids=[0, 1, 2], target_hidden=H,
        embedding=_embedding(V, 48), norm_before_residual=True, norm_before_fc=True)),
    "medusa": ("medusa", lambda d: write_medusa(d, H, V, num_heads=3)),  # sizes only in the weights
    "medusa_pt": ("medusa", lambda d: write_medusa(d, H, V, num_heads=3, fmt="pt")),
    "medusa_more_heads": ("medusa", lambda d: write_medusa(d, H, V, num_heads=3, medusa_num_heads=2)),
    "medusa_v2": ("medusa", lambda d: write_medusa(d, H, V, num_heads=3, layout="medusa_v2", fmt="pt")),
    "medusa2_full": ("medusa", lambda d: write_medusa(d, H, V, num_heads=3, layout="medusa2_full")),
    "medusa_vllm": ("medusa", lambda d: write_medusa(d, H, V, num_heads=3, layout="vllm")),
    "medusa_vllm_truncated": ("medusa", lambda d: write_medusa(d, H, V, num_heads=2, layout="vllm",
                                                               truncated_vocab_size=40)),
    "mlp_speculator": ("mlp_speculator", lambda d: write_mlp_speculator(d, H, V, n_predict=3)),
    "mlp_speculator_tied_bin": ("mlp_speculator", lambda d: write_mlp_speculator(
        d, H, V, n_predict=3, tie_weights=True, scale_input=True, weights_format="bin")),
    "arctic_mlp": ("arctic", lambda d: write_arctic(d, H, V, kind="mlp")),
    "arctic_lstm": ("arctic", lambda d: write_arctic(d, H, V, kind="lstm")),
}
NO_VOCAB = {"medusa_v2"}  # blocks only (projected by the target's LM head): its weights say the hidden size only


def _target(folder: Path, hidden: int, vocab: int, layers: int = LAYERS, arch: str = "LlamaForCausalLM") -> Path:
    """A target folder of only a config.json (all TargetInfo.from_folder reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "llama", "hidden_size": hidden, "vocab_size": vocab,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 2048, "tie_word_embeddings": True}))
    return folder


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {name: write(root / name) for name, (_, write) in HEADS.items()}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {"same": _target(root / "tiny", H, V), "other": _target(root / "bigger", OTHER_H, OTHER_V),
            "other_vocab": _target(root / "other-vocab", H, OTHER_V)}


def _refusal(path, target) -> HeadFitError:
    with pytest.raises(HeadFitError) as e:
        check_heads_fit(str(path), target)
    return e.value


@pytest.mark.parametrize("name", HEADS)
def test_a_head_made_for_the_target_passes(heads, targets, name):
    check_heads_fit(str(heads[name]), targets["same"])


@pytest.mark.parametrize("name", HEADS)
def test_a_head_made_for_another_target_is_refused_naming_both(heads, targets, name):
    method, head, target = HEADS[name][0], heads[name], targets["other"]
    err = _refusal(head, target)
    msg = str(err)
    assert f"speculator head {head} ({method}) was made for a target of hidden size {H}" in msg
    assert (f"and vocabulary {V}" in msg) is (name not in NO_VOCAB)
    assert f"not for the served target {target} (hidden size {OTHER_H}, vocabulary {OTHER_V})" in msg
    assert "\n" not in msg and msg.count(str(head)) == 1
    # the loader's error, kept on the exception
    assert isinstance(err, SpeculatorLoadError) and isinstance(err, ValueError)
    assert err.head == head and err.method == method and err.target == target
    assert Path(err.file).parent == head and repr(err.key) in msg and err.detail in msg


@pytest.mark.parametrize("name", sorted(set(HEADS) - NO_VOCAB))
def test_another_vocabulary_alone_is_refused(heads, targets, name):
    msg = str(_refusal(heads[name], targets["other_vocab"]))
    assert f"vocabulary {V}" in msg and f"(hidden size {H}, vocabulary {OTHER_V})" in msg


def test_an_eagle3_head_for_llama_3_1_8b_beside_smollm2(tmp_path):
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config (tiny weights: the check reads none) beside the embedded target
    head = write_eagle3(tmp_path / "EAGLE3-LLaMA3.1-Instruct-8B", H, V, 4, 2, 64, 48, hidden_size=4096,
                        vocab_size=128256, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=128, draft_vocab_size=32000, max_position_embeddings=2048)
    target = _target(tmp_path / "SmolLM2-135M-Instruct", 576, 49152, layers=30)
    err = _refusal(head, target)
    print(err)
    assert str(err) == (
        f"speculator head {head} (eagle3) was made for a target of hidden size 4096 and vocabulary 128256, not for "
        f"the served target {target} (hidden size 576, vocabulary 49152): serve it with the target it was made for, "
        f"or give a head made for this target (config.json 'hidden_size': 4096 does not fit the target's hidden size "
        f"(no target_hidden_size given) (576))")
    assert err.key == "hidden_size" and err.file == str(head / "config.json")


def test_the_target_name_a_config_records_is_named(tmp_path, targets):
    speculators = write_eagle3(tmp_path / "speculators", H, V, 4, 2, 64, 48, layout="speculators",
                               embedding=_embedding())
    cfg = json.loads((speculators / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    (speculators / "config.json").write_text(json.dumps(cfg))
    assert "vocabulary 97 (meta-llama/Llama-3.1-8B-Instruct), not for" in str(_refusal(speculators, targets["other"]))
    medusa = write_medusa(tmp_path / "medusa", H, V, num_heads=2)  # base_model_name_or_path
    assert f"vocabulary 97 ({BASE_MODEL}), not for" in str(_refusal(medusa, targets["other"]))


def test_a_misfit_of_another_kind_names_the_loaders_reason(tmp_path, targets):
    # EAGLE-3 layer ids beyond a target of two layers; an Arctic head trained for another architecture
    eagle3 = write_eagle3(tmp_path / "eagle3", H, V, 4, 2, 64, 48, layer_ids=[0, 1, 5])
    msg = str(_refusal(eagle3, targets["same"]))
    assert msg.startswith(f"speculator head {eagle3} (eagle3) does not fit the served target {targets['same']} "
                          f"(hidden size {H}, vocabulary {V}, {LAYERS} layers): config.json "
                          f"'eagle_aux_hidden_state_layer_ids': must be layer ids in [0, {LAYERS}]")
    qwen = _target(tmp_path / "qwen", H, V, arch="Qwen2ForCausalLM")
    arctic = write_arctic(tmp_path / "arctic", H, V, kind="mlp")
    err = _refusal(arctic, qwen)
    assert err.key == "base_model_archs" and "not for the target's Qwen2ForCausalLM" in str(err)


def test_every_head_of_the_path_is_checked_in_order(heads, targets, tmp_path):
    bad = write_mlp_speculator(tmp_path / "mlp_for_another", OTHER_H, OTHER_V, n_predict=2)
    path = ",".join(str(heads[n]) for n in ("eagle3", "medusa")) + f":{bad}"
    err = _refusal(path, targets["same"])
    assert err.head == bad and err.method == "mlp_speculator" and err.key == "emb_dim"
    check_heads_fit(",".join(str(heads[n]) for n in ("eagle1", "eagle3", "medusa", "mlp_speculator", "arctic_lstm")),
                    targets["same"])
    check_heads_fit("none", targets["other"])
    check_heads_fit("", targets["other"])


def test_what_served_heads_refuses_is_its_own_error(tmp_path, targets):
    with pytest.raises(SpeculatorLoadError, match="no such folder") as e:
        check_heads_fit(str(tmp_path / "missing"), targets["same"])
    assert not isinstance(e.value, HeadFitError)
    with pytest.raises(SpeculatorLoadError, match="the target's config does not read"):
        check_heads_fit("none", tmp_path / "no-target")


@pytest.mark.parametrize("name", ["eagle1", "eagle1_vllm", "eagle3", "eagle3_speculators_wider", "medusa", "medusa_pt",
                                  "medusa2_full", "mlp_speculator", "arctic_mlp", "arctic_lstm"])
def test_the_check_is_the_loaders_own(heads, targets, name):
    # the same file, key and words as loading the head (Medusa in vLLM's layout: its loader names the weight first)
    from spec_decode.proposers.eagle import load_eagle1, load_eagle3
    from spec_decode.proposers.speculators.arctic import load_arctic
    from spec_decode.proposers.speculators.medusa import load_medusa
    from spec_decode.proposers.speculators.mlp import load_mlp_speculator
    from spec_decode.proposers.speculators.target import TargetInfo

    loaders = {"eagle": load_eagle1, "eagle3": load_eagle3, "medusa": load_medusa,
               "mlp_speculator": load_mlp_speculator, "arctic": load_arctic}
    fit = _refusal(heads[name], targets["other"])
    with pytest.raises(SpeculatorLoadError) as e:
        loaders[HEADS[name][0]](heads[name], TargetInfo.from_folder(targets["other"]))
    assert (fit.file, fit.key, fit.detail) == (e.value.file, e.value.key, e.value.detail)


class _NoDataSafeOpen:
    """safetensors.safe_open that reads names and shapes only: reading a tensor fails the test."""

    real = safetensors.safe_open

    def __init__(self, *args, **kwargs):
        self.file = self.real(*args, **kwargs)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def metadata(self):
        return self.file.metadata()

    def get_slice(self, name):
        shape = self.file.get_slice(name).get_shape()
        return type("ShapeOnly", (), {"get_shape": lambda _self: shape})()

    def get_tensor(self, name):
        raise AssertionError(f"read the data of {name}")


def test_no_weight_data_is_read(heads, targets, monkeypatch):
    # the loaders' reader, safetensors' tensors and an unmapped torch.load fail: a memory-mapped pickle is read for its
    # structure only (a tensor's data is read when it is used)
    from spec_decode.proposers.eagle import eagle3_published, published
    from spec_decode.proposers.speculators import arctic, checkpoint, mlp
    from spec_decode.proposers.speculators.medusa import published as medusa

    def refuse(*args, **kwargs):
        raise AssertionError("weight data read")

    for module in (checkpoint, eagle3_published, published, medusa, mlp, arctic):
        monkeypatch.setattr(module, "load_weights", refuse)
    monkeypatch.setattr(safetensors, "safe_open", _NoDataSafeOpen)
    monkeypatch.setattr("safetensors.torch.load_file", refuse)
    real_load = torch.load

    def mapped_only(*args, **kwargs):
        if not kwargs.get("mmap"):
            refuse()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", mapped_only)
    for name in HEADS:
        check_heads_fit(str(heads[name]), targets["same"])
        _refusal(heads[name], targets["other"])
    with pytest.raises(AssertionError, match="weight data read"):  # the patches hold: loading reads the data
        from spec_decode.proposers.speculators.mlp import load_mlp_speculator
        from spec_decode.proposers.speculators.target import TargetInfo

        load_mlp_speculator(heads["mlp_speculator"], TargetInfo.from_folder(targets["same"]))


def test_weight_shapes_reads_headers_and_mapped_pickles(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    torch.save({"state_dict": tensors}, tmp_path / "wrapped.pt")
    torch.save(tensors, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    want = {"a.weight": (3, 4), "b": (5,)}
    for name in ("model.safetensors", "pytorch_model.bin", "wrapped.pt"):
        assert weight_shapes(tmp_path / name) == want
    assert weight_shapes(tmp_path / "legacy.bin") is None  # cannot be mapped: the check skips its shapes
    assert weight_names(tmp_path / "legacy.bin") == ["a.weight", "b"]  # read whole, as before
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(SpeculatorLoadError, match="unreadable"):
        weight_shapes(tmp_path / "bad.safetensors")
