"""spec_decode.engine.aux_states and target_model's ``hidden_states`` for EAGLE-3 heads: [k+1, H x (1 + A)], the last
hidden state then the inputs of the A ``aux_hidden_state_layers`` (vLLM's ``aux_hidden_states``), equal to what
transformers returns as ``output_hidden_states`` (entry i is the input of layer i), through KV-cached steps and
batched rows."""

import pytest
import torch

from spec_decode.engine.aux_states import AuxHiddenStates
from spec_decode.serving.target_model import TargetBackend
from tests.helpers import step_row
from tests.speculator_checkpoints.eagle import write_eagle1, write_eagle3

H = 32


@pytest.fixture(scope="module")
def heads(deep_lm, tmp_path_factory):
    """An EAGLE-3 head reading layers 1, 4 and 5 of the 6-layer deep target, and an EAGLE-1 head of it."""
    root = tmp_path_factory.mktemp("aux")
    return {"eagle3": write_eagle3(root / "eagle3", H, 97, 4, 2, 64, 48, layer_ids=[5, 1, 4]),
            "eagle": write_eagle1(root / "eagle", deep_lm.get_input_embeddings().weight.detach(), 4, 2, 64)}


def _expected(model, ids, rows, layers):
    """transformers' hidden states of the whole sequence at positions ``rows``: the last (after the final norm), then
    the input of each layer of ``layers``: [len(rows), H x (1 + len(layers))]."""
    with torch.inference_mode():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[-1][0, rows]] + [hs[i][0, rows] for i in layers], -1)


def _params(deep_dir, **kw):
    return {"model_path": str(deep_dir), "device": "cpu", "dtype": "float32", **kw}


def test_the_target_returns_the_eagle3_head_s_layers_beside_its_last_hidden_state(deep_lm, deep_dir, heads):
    draft = {"speculator_path": f"{heads['eagle']},{heads['eagle3']}"}
    target = TargetBackend(_params(deep_dir), draft_params=draft)
    assert target.lm._aux.layers == [1, 4, 5]
    # one row alone, then its next step from its KV cache (only the new positions run)
    out = target.run(step_row(1, [5, 6, 7], [8, 9]))["hidden_states"]
    assert out.shape == (3, H * 4)
    torch.testing.assert_close(out, _expected(deep_lm, [5, 6, 7, 8, 9], [2, 3, 4], [1, 4, 5]), atol=1e-5, rtol=1e-4)
    out = target.run(step_row(1, [5, 6, 7, 8, 2], [3]))["hidden_states"]
    torch.testing.assert_close(out, _expected(deep_lm, [5, 6, 7, 8, 2, 3], [4, 5], [1, 4, 5]), atol=1e-5, rtol=1e-4)
    # a batch of rows of other lengths (one padded forward): each row's own states
    rows = [([1, 2, 3, 4, 5, 6, 7], [8]), ([40, 41], [42, 43, 44]), ([9], [])]
    outs = target.run_batch([step_row(10 + i, ids, drafts) for i, (ids, drafts) in enumerate(rows)])
    for (ids, drafts), o in zip(rows, outs):
        n = len(ids)
        want = _expected(deep_lm, ids + drafts, list(range(n - 1, n + len(drafts))), [1, 4, 5])
        torch.testing.assert_close(o["hidden_states"], want, atol=1e-5, rtol=1e-4)


def test_aux_hidden_state_layers_is_auto_none_or_ids(deep_lm, deep_dir, heads, tmp_path):
    eagle3 = {"speculator_path": str(heads["eagle3"])}
    plain = TargetBackend(_params(deep_dir), draft_params={"speculator_path": str(heads["eagle"])})
    assert plain.lm._aux.layers == []  # EAGLE-1 reads the last hidden state only
    out = plain.run(step_row(1, [5, 6, 7], [8]))["hidden_states"]
    torch.testing.assert_close(out, _expected(deep_lm, [5, 6, 7, 8], [2, 3], []), atol=1e-5, rtol=1e-4)
    assert TargetBackend(_params(deep_dir)).lm._aux.layers == []  # draft_model's default: the trained head, none here
    assert TargetBackend(_params(deep_dir, aux_hidden_state_layers="none"), draft_params=eagle3).lm._aux.layers == []
    explicit = TargetBackend(_params(deep_dir, aux_hidden_state_layers="0,3"), draft_params=eagle3)
    out = explicit.run(step_row(1, [5, 6, 7], [8]))["hidden_states"]
    torch.testing.assert_close(out, _expected(deep_lm, [5, 6, 7, 8], [2, 3], [0, 3]), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="aux_hidden_state_layers"):
        TargetBackend(_params(deep_dir, aux_hidden_state_layers="two"))
    # a head draft_model cannot load adds no layers here (draft_model's own load fails, naming the fault)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    assert TargetBackend(_params(deep_dir), draft_params={"speculator_path": str(tmp_path / "broken")}).lm._aux.layers \
        == []


def test_aux_hidden_states_refuses_layers_the_decoder_does_not_have(deep_lm):
    decoder = deep_lm.get_decoder()
    for bad in ([7], [-1], [1, 1]):
        with pytest.raises(ValueError, match=r"distinct ids in \[0, 6\]"):
            AuxHiddenStates(decoder, bad)
    with pytest.raises(ValueError, match="no `layers`"):
        AuxHiddenStates(torch.nn.Linear(2, 2), [0])
    none = AuxHiddenStates(torch.nn.Linear(2, 2), [])
    x = torch.randn(1, 3, H)
    assert none.gather(x, torch.zeros(1, 3, dtype=torch.long)) is x


def test_layer_l_is_the_last_layer_s_output_before_the_final_norm(deep_lm):
    """Id L (6 of 6 layers; heads such as nvidia/gpt-oss-120b-Eagle3-v3 name it) is the residual stream leaving the
    last layer: the final norm of it is transformers' last hidden state."""
    aux = AuxHiddenStates(deep_lm.model, [2, 6])
    with torch.inference_mode():
        hs = deep_lm(torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True).hidden_states
        out = aux.gather(hs[-1][:, [1, 3]], torch.tensor([[1, 3]]))
        torch.testing.assert_close(deep_lm.model.norm(out[..., 2 * H:]), hs[-1][:, [1, 3]], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out[..., H: 2 * H], hs[2][:, [1, 3]])
        assert not torch.allclose(out[..., 2 * H:], hs[-1][:, [1, 3]], atol=1e-3)  # before the norm, not after


def test_the_hooks_go_with_the_object_that_registered_them(deep_lm):
    """A model served by many caches over its life (tests, reloads) keeps no hooks of the caches that are gone."""
    import gc

    layers = deep_lm.model.layers
    before = [len(layer._forward_pre_hooks) for layer in layers]
    aux = AuxHiddenStates(deep_lm.model, [1, 4])
    assert [len(layer._forward_pre_hooks) for layer in layers][1] == before[1] + 1
    with torch.inference_mode():
        deep_lm(torch.tensor([[5, 6, 7]]))
    assert aux.gather(torch.zeros(1, 2, H), torch.tensor([[1, 2]])).shape == (1, 2, 3 * H)
    del aux
    gc.collect()
    assert [len(layer._forward_pre_hooks) for layer in layers] == before
