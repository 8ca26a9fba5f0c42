"""spec_decode.proposers.speculators.medusa: published Medusa heads in both layouts (FasterDecoding's, vLLM's
conversion) and both file formats, their maths against a hand-written reference, the proposer's drafts (batched,
head i at slot i, k capped at the heads, processors, the confidence rule) and the load errors."""

import pytest
import torch
import torch.nn.functional as F

from spec_decode.processors import ProcessorSpec
from spec_decode.proposers import ProposalRequest
from spec_decode.proposers.speculators import SpeculatorLoadError, SpeculatorSettings, TargetInfo, detect
from spec_decode.proposers.speculators.checkpoint import load_weights
from spec_decode.proposers.speculators.medusa import MedusaHead, MedusaProposer, load_medusa
from spec_decode.sampling import SamplingParams
from tests.speculator_checkpoints.medusa import write_medusa

H, V = 32, 97
FILES = {("medusa", "safetensors"): "medusa_lm_head.safetensors", ("medusa", "pt"): "medusa_lm_head.pt",
         ("vllm", "safetensors"): "model.safetensors", ("vllm", "pt"): "pytorch_model.bin"}


@pytest.fixture(scope="module")
def target(tiny_lm):
    return TargetInfo.from_model(tiny_lm)


def _states(n, seed=0):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)) * 2


def _reference(state, x, n, layers, layout, lm_head=None, token_map=None):
    """The published maths by hand: per head, x <- x + SiLU(x W^T + b) over its blocks, then x P^T ([n, B, V])."""
    out = []
    for i in range(n):
        y = x
        for j in range(layers):
            w, b = ((state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"]) if layout == "medusa" else
                    (state[f"blocks.{i}.layers.{j}.weight"], state.get(f"blocks.{i}.layers.{j}.bias")))
            y = y + F.silu(y @ w.T + (0 if b is None else b))
        p = state[f"{i}.{layers}.weight"] if layout == "medusa" else state.get(f"lm_heads.{i}.weight", lm_head)
        logits = y @ p.T
        if token_map is not None:
            full = torch.full((len(x), V), float("-inf"))
            full[:, token_map] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


def _proposer(head, min_token_prob=0.0):
    return MedusaProposer(head, H, SpeculatorSettings(speculator_path="", speculator_min_token_prob=min_token_prob))


def _request(seq, states, k, params=None, processors=None, ids=None):
    ids = ids if ids is not None else list(range(1, len(states) + 2))
    return ProposalRequest(seq, ids, k, params or SamplingParams(), 0, states, processors)


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_both_layouts_are_detected_as_medusa(tmp_path, layout):
    assert detect(write_medusa(tmp_path / layout, H, V, layout=layout)) == "medusa"


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_the_loaded_head_computes_the_published_maths(tmp_path, target, layout, fmt):
    folder = write_medusa(tmp_path / "m", H, V, num_heads=3, num_layers=2, layout=layout, fmt=fmt, seed=3)
    state = load_weights(folder / FILES[layout, fmt])
    head = load_medusa(folder, target)
    assert isinstance(head, MedusaHead) and (head.num_heads, head.num_layers) == (3, 2) and not head.training
    x = _states(5)
    torch.testing.assert_close(head(x), _reference(state, x, 3, 2, layout))
    torch.testing.assert_close(head(x, heads=2), head(x)[:2])


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_vllm_variants_shared_lm_head_no_bias_and_truncated_vocabulary(tmp_path, target, tiny_lm, fmt):
    x = _states(4, seed=1)
    lm = tiny_lm.get_output_embeddings().weight.detach().float()
    # original_lm_head without lm_heads weights: every head projects with the target's LM head
    folder = write_medusa(tmp_path / "shared", H, V, 2, layout="vllm", fmt=fmt, original_lm_head=True,
                          medusa_fc_bias=False)
    state = load_weights(folder / FILES["vllm", fmt])
    assert not any("lm_heads" in k or k.endswith(".bias") for k in state)
    torch.testing.assert_close(load_medusa(folder, target)(x), _reference(state, x, 2, 1, "vllm", lm_head=lm))
    # biases unset in the config: read when the conversion kept them
    folder = write_medusa(tmp_path / "bias", H, V, 2, layout="vllm", fmt=fmt, medusa_fc_bias=None)
    state = load_weights(folder / FILES["vllm", fmt])
    torch.testing.assert_close(load_medusa(folder, target)(x), _reference(state, x, 2, 1, "vllm"))
    # truncated_vocab_size with a token_map: the other ids get -inf
    folder = write_medusa(tmp_path / "cut", H, V, 2, layout="vllm", fmt=fmt, truncated_vocab_size=40, logit_scale=0.5)
    state = load_weights(folder / FILES["vllm", fmt])
    want = _reference(state, x, 2, 1, "vllm", token_map=state["token_map"]) * 0.5
    got = load_medusa(folder, target)(x)
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got).sum(-1).eq(40).all()


def test_published_faster_decoding_variants(tmp_path, target, tiny_lm):
    """FasterDecoding's variants, each against the published maths: a config that says fewer heads than the file
    holds (medusa-vicuna-7b-v1.3: 2 said, 5 held; the authors' code forces 5) serves the file's; version 2
    (train_legacy.py, TGI's MedusaHeadV2) projects its blocks with the target's LM head; a Medusa-2 full model
    (medusa-1.0-*, sharded) serves the medusa_head weights out of its shards."""
    x = _states(4, seed=2)
    lm = tiny_lm.get_output_embeddings().weight.detach().float()
    folder = write_medusa(tmp_path / "vicuna", H, V, num_heads=5, fmt="pt", config={"medusa_num_heads": 2})
    state = load_weights(folder / "medusa_lm_head.pt")
    head = load_medusa(folder, target)
    assert head.num_heads == 5
    torch.testing.assert_close(head(x), _reference(state, x, 5, 1, "medusa"))
    folder = write_medusa(tmp_path / "v2", H, V, num_heads=3, layout="medusa_v2", fmt="pt")
    state = load_weights(folder / "medusa_lm_head.pt")
    assert not any(k.endswith(".1.weight") for k in state)
    want = torch.stack([(x + F.silu(x @ state[f"{i}.0.linear.weight"].T + state[f"{i}.0.linear.bias"])) @ lm.T
                        for i in range(3)])
    torch.testing.assert_close(load_medusa(folder, target)(x), want)
    folder = write_medusa(tmp_path / "full", H, V, num_heads=4, num_layers=1, layout="medusa2_full")
    assert detect(folder) == "medusa"
    state = {k.removeprefix("medusa_head."): t for k, t in
             load_weights(folder / "model-00002-of-00002.safetensors").items()}
    torch.testing.assert_close(load_medusa(folder, target)(x), _reference(state, x, 4, 1, "medusa"))


def test_a_full_model_without_medusa_heads_is_refused_naming_why(tmp_path, target):
    import json

    folder = write_medusa(tmp_path / "full", H, V, num_heads=2, layout="medusa2_full")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if not k.startswith("medusa_head.")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    err = _load_error(folder, target)
    assert err.key == "medusa_head." and "no Medusa head weight" in err.detail


def test_drafts_head_i_at_slot_i_with_k_capped_at_the_heads(target, tmp_path):
    head = load_medusa(write_medusa(tmp_path / "m", H, V, num_heads=3), target)
    p = _proposer(head)
    states = _states(6, seed=2)
    logits = head(states[-1:])[:, 0]  # [3, V]: the last state drafts
    probs = torch.softmax(logits, -1)
    want = probs.argmax(-1)
    out = p.propose_one(1, list(range(7)), 8, hidden_states=states)  # k = 8, 3 heads: 3 drafts
    assert out.draft_token_ids.tolist() == want.tolist() and out.draft_probs is None
    running = torch.cumprod(probs[torch.arange(3), want].double(), 0)
    assert out.score == pytest.approx(float(running.sum()), rel=1e-5)
    assert p.propose_one(1, list(range(7)), 2, hidden_states=states).draft_token_ids.tolist() == want[:2].tolist()


def test_a_batch_drafts_as_each_request_alone(target, tmp_path):
    head = load_medusa(write_medusa(tmp_path / "m", H, V, num_heads=4, layout="vllm", seed=5), target)
    p = _proposer(head)
    g = torch.Generator().manual_seed(4)
    reqs = []
    for seq in range(6):
        m = 1 + seq % 3
        states = None if seq == 2 else torch.randn(m, H, generator=g) * 2
        params = SamplingParams(temperature=0.8, top_k=20, seed=seq, seeded=True) if seq % 2 else SamplingParams()
        reqs.append(ProposalRequest(seq, torch.randint(0, V, (m + 1,), generator=g).tolist(), 1 + seq, params, seq,
                                    states))
    batch = p.propose(reqs)
    for r, b in zip(reqs, batch):
        (one,) = p.propose([r])
        assert b.draft_token_ids.tolist() == one.draft_token_ids.tolist()
        assert b.score == (None if one.score is None else pytest.approx(one.score, rel=1e-4))
        assert len(b.draft_token_ids) == (0 if r.hidden_states is None else min(r.k, 4))
    assert batch[2].draft_token_ids.numel() == 0 and batch[2].score is None


def test_no_hidden_states_no_drafts(target, tmp_path):
    p = _proposer(load_medusa(write_medusa(tmp_path / "m", H, V), target))
    assert p.propose_one(1, [1, 2, 3], 4).draft_token_ids.numel() == 0
    assert p.propose_one(1, [1, 2, 3], 4, hidden_states=torch.empty(0, H)).draft_token_ids.numel() == 0
    assert p.propose([]) == []


def test_drafts_follow_the_processors_and_are_the_argmax_for_sampled_requests(target, tmp_path):
    head = load_medusa(write_medusa(tmp_path / "m", H, V, num_heads=4), target)
    p = _proposer(head)
    states, ids = _states(4, seed=6), [5, 6, 7, 8, 9]
    plain = p.propose_one(1, ids, 4, hidden_states=states).draft_token_ids.tolist()
    # sampled requests draft deterministically: the argmax of each head's transformed distribution
    for params in (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, seeded=True),
                   SamplingParams(temperature=1.3, seed=11)):
        assert p.propose_one(1, ids, 4, params, 7, states).draft_token_ids.tolist() == plain
    banned = tuple(sorted(set(plain)))
    spec = ProcessorSpec(prompt_len=len(ids), bad_words=tuple((t,) for t in banned))
    out = p.propose_one(1, ids, 4, hidden_states=states, processors=spec).draft_token_ids.tolist()
    logits = head(states[-1:])[:, 0]
    logits[:, list(banned)] = float("-inf")
    assert len(out) == 4 and not set(out) & set(banned) and out == logits.argmax(-1).tolist()


def test_the_confidence_rule_cuts_the_drafts(target, tmp_path):
    head = load_medusa(write_medusa(tmp_path / "m", H, V, num_heads=4, seed=9), target)
    states = _states(3, seed=8)
    every = _proposer(head).propose_one(1, [1, 2, 3, 4], 4, hidden_states=states)
    probs = torch.softmax(head(states[-1:])[:, 0], -1).double()
    chosen = probs[torch.arange(4), every.draft_token_ids]
    running = torch.cumprod(chosen, 0)
    confidence = torch.cat([torch.ones(1, dtype=torch.float64), running[:-1]]) * probs.max(-1).values
    for t in (0.0, float(confidence[1]) + 1e-6, float(confidence[2]) + 1e-6, 0.999999):
        cut = _proposer(head, t).propose_one(1, [1, 2, 3, 4], 4, hidden_states=states)
        n = int((confidence >= t).cumprod(0).sum())
        assert cut.draft_token_ids.tolist() == every.draft_token_ids[:n].tolist()
        if n:
            assert cut.score == pytest.approx(float(running[:n].sum()), rel=1e-5)


def test_served_through_from_config(tmp_path, tiny_dir, tiny_lm):
    folder = write_medusa(tmp_path / "m", H, V, num_heads=3, layout="vllm", original_lm_head=True)
    settings = SpeculatorSettings(speculator_path=str(folder), target_model_path=str(tiny_dir),
                                  speculator_min_token_prob=0.0)
    assert MedusaProposer.configured(settings)
    p = MedusaProposer.from_config(settings, {})
    assert isinstance(p, MedusaProposer) and p.name == "medusa" and p.hidden_size == H and p.min_token_prob == 0.0
    assert p.needs_hidden_states and p.applies_processors
    lm = tiny_lm.get_output_embeddings().weight.detach().float()
    torch.testing.assert_close(p.head.lm_heads[0].weight.float().cpu(), lm, atol=1e-2, rtol=1e-2)
    # the target's own last hidden states (after its final norm) draft 3 tokens
    ids = [3, 14, 15, 92, 65, 35]
    with torch.no_grad():
        hidden = tiny_lm(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, :-1]
    r = ProposalRequest(1, ids, 5, SamplingParams(), 0, hidden)
    p.check(r)
    cpu = MedusaProposer.from_config(SpeculatorSettings(speculator_path=str(folder), target_model_path=str(tiny_dir),
                                                        speculator_min_token_prob=0.0, device="cpu"), {})
    assert cpu is not None and cpu.head.lm_heads[0].weight.dtype == torch.float32
    (out,) = cpu.propose([r])
    want = cpu.head(hidden[-1:])[:, 0].argmax(-1)
    assert out.draft_token_ids.tolist() == want.tolist() and len(p.propose([r])[0].draft_token_ids) == 3


def _load_error(folder, target):
    with pytest.raises(SpeculatorLoadError) as e:
        load_medusa(folder, target)
    return e.value


@pytest.mark.parametrize(("layout", "fmt", "case", "file", "key"), [
    ("medusa", "safetensors", "hidden", "medusa_lm_head.safetensors", "0.0.linear.weight"),
    ("medusa", "pt", "vocab", "medusa_lm_head.pt", "0.1.weight"),
    ("medusa", "safetensors", "missing", "medusa_lm_head.safetensors", "1.0.linear.bias"),
    ("medusa", "safetensors", "no_heads", "config.json", "medusa_num_heads"),
    ("medusa", "pt", "bad_heads", "config.json", "medusa_num_heads"),
    ("vllm", "safetensors", "hidden", "model.safetensors", "blocks.0.layers.0.weight"),
    ("vllm", "pt", "vocab", "pytorch_model.bin", "lm_heads.0.weight"),
    ("vllm", "safetensors", "missing", "model.safetensors", "lm_heads.1.weight"),
    ("vllm", "safetensors", "config_vocab", "config.json", "vocab_size"),
    ("vllm", "safetensors", "no_heads", "config.json", "num_heads"),
    ("vllm", "safetensors", "no_token_map", "model.safetensors", "token_map"),
])
def test_load_errors_name_the_file_and_the_key(tmp_path, target, layout, fmt, case, file, key):
    heads = "medusa_num_heads" if layout == "medusa" else "num_heads"
    sizes, kwargs = {"hidden": ((48, V), {}), "vocab": ((H, 50), {}),
                     "missing": ((H, V), {"drop_weights": ("1.0.linear.bias", "lm_heads.1.weight")}),
                     "no_heads": ((H, V), {"config": {heads: None}}), "bad_heads": ((H, V), {"config": {heads: 0}}),
                     "config_vocab": ((H, V), {"config": {"vocab_size": 100, "truncated_vocab_size": None}}),
                     "no_token_map": ((H, V), {"truncated_vocab_size": 40, "drop_weights": ("token_map",)})}[case]
    folder = write_medusa(tmp_path / "m", *sizes, 2, layout=layout, fmt=fmt, **kwargs)
    err = _load_error(folder, target)
    assert err.key == key and err.file == str(folder / file)
    assert str(folder / file) in str(err) and repr(key) in str(err)


def test_a_folder_of_neither_layout_names_medusa_num_heads(tmp_path, target):
    folder = write_medusa(tmp_path / "m", H, V, medusa_num_heads=None)
    err = _load_error(folder, target)
    assert err.key == "medusa_num_heads" and err.file.endswith("config.json")
    err = _load_error(write_medusa(tmp_path / "n", H, V, medusa_num_heads="4"), target)
    assert err.key == "medusa_num_heads" and "'4'" in err.detail


# -- candidate trees -----------------------------------------------------------------------------------------------


def _brute_force(top_probs, budget, min_prob):
    """Every path of top-k indices within the heads, by joint probability (distinct here), the best ``budget``."""
    import itertools

    paths = [p for d in range(1, len(top_probs) + 1) for p in itertools.product(*(range(len(t)) for t in
                                                                                  top_probs[:d]))]
    joint = {p: float(torch.tensor([top_probs[i][c] for i, c in enumerate(p)], dtype=torch.float64).prod())
             for p in paths}
    return [p for p in sorted(paths, key=lambda p: -joint[p]) if joint[p] >= min_prob][:budget], joint


@pytest.mark.parametrize(("budget", "min_prob"), [(1, 0.0), (5, 0.0), (12, 0.0), (12, 0.05), (40, 0.0)])
def test_the_dynamic_tree_is_the_budget_s_most_probable_paths_best_first(budget, min_prob):
    from spec_decode.proposers.speculators.medusa.tree import dynamic_tree
    from spec_decode.tree import check_tree

    g = torch.Generator().manual_seed(budget)
    top_probs = [sorted(torch.rand(4, generator=g).mul(0.9).tolist(), reverse=True) for _ in range(3)]
    got = dynamic_tree(top_probs, budget, min_prob)
    want, joint = _brute_force(top_probs, budget, min_prob)
    assert got == want
    assert all(joint[a] >= joint[b] for a, b in zip(got, got[1:]))
    index = {p: i for i, p in enumerate(got)}
    check_tree(list(range(len(got))), [-1 if len(p) == 1 else index[p[:-1]] for p in got])  # parents first


def test_a_fixed_tree_keeps_its_first_nodes_that_the_heads_and_the_threshold_allow():
    from spec_decode.proposers.speculators.medusa.tree import PUBLISHED_CHOICES, choices_tree, parse_choices

    choices = parse_choices("mc_sim_7b_63")
    assert choices is not None and len(choices) == 63 and choices[:4] == [(0,), (0, 0), (1,), (0, 1)]
    assert choices == [tuple(p) for p in PUBLISHED_CHOICES["mc_sim_7b_63"]]
    top = [[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]  # 2 heads, top 3: depth-3 paths and index 3+ are left out
    assert choices_tree(choices, top, 6, 0.0) == [(0,), (0, 0), (1,), (0, 1), (2,), (1, 0)]
    # (1,) joint 0.3 passes 0.2, its children 0.15 and 0.12 do not; (2,) 0.1 does not
    assert choices_tree(choices, top, 8, 0.2) == [(0,), (0, 0), (1,), (0, 1)]
    assert parse_choices("[[0], [0, 0], [1]]") == [(0,), (0, 0), (1,)] and parse_choices("dynamic") is None


@pytest.mark.parametrize(("value", "why"), [
    ("[[0, 0], [0]]", "before its parent"), ("[[0], [0]]", "twice"), ("[[0], []]", "non-empty"),
    ("[[-1]]", "in [0, 10)"), ("[[10]]", "in [0, 10)"), ("[[true]]", "in [0, 10)"), ("[]", "non-empty JSON list"),
    ("tree", "dynamic"), ("{\"a\": 1}", "mc_sim_7b_63")])
def test_bad_medusa_choices_are_refused_naming_the_parameter_and_what_is_allowed(value, why):
    with pytest.raises(ValueError, match="medusa_choices") as err:
        SpeculatorSettings.from_params({"medusa_choices": value})
    assert why in str(err.value)


def test_a_long_path_out_of_order_is_named_short():
    with pytest.raises(ValueError, match=r"\(5001 indices\)") as err:
        SpeculatorSettings.from_params({"medusa_choices": str([[0] * 5001])})
    assert len(str(err.value)) < 300


@pytest.mark.parametrize("choices", ["dynamic", "mc_sim_7b_63"])
def test_a_tree_request_gets_the_heads_top_k_combined(target, tmp_path, choices):
    """draft_tree: the proposal is the tree of the heads' top-k tokens that the rule picks (no draft_probs), at most k
    nodes; a chain request of the same state gets the chain of each head's argmax, which is the tree's first path."""
    from spec_decode.proposers.speculators.medusa.tree import choices_tree, dynamic_tree, parse_choices
    from spec_decode.tree import path_tokens

    head = load_medusa(write_medusa(tmp_path / "m", H, V, num_heads=3), target)
    p = MedusaProposer(head, H, SpeculatorSettings(speculator_path="", speculator_min_token_prob=0.0,
                                                   medusa_choices=choices))
    states = _states(5, seed=3)
    probs = torch.softmax(head(states[-1:])[:, 0], -1)  # [3, V]
    top = torch.topk(probs, 6, dim=-1)
    top_probs = top.values.double().tolist()
    k = 6
    paths = (dynamic_tree(top_probs, k, 0.0) if choices == "dynamic"
             else choices_tree(parse_choices(choices), top_probs, k, 0.0))
    tree = p.propose([ProposalRequest(1, list(range(6)), k, SamplingParams(), 0, states, tree=True)])[0]
    assert tree.draft_probs is None and tree.draft_parents is not None and len(tree.draft_token_ids) == len(paths) == k
    index = {q: i for i, q in enumerate(paths)}
    assert tree.draft_parents.tolist() == [-1 if len(q) == 1 else index[q[:-1]] for q in paths]
    assert tree.draft_token_ids.tolist() == [int(top.indices[len(q) - 1, q[-1]]) for q in paths]
    chain = p.propose_one(1, list(range(6)), k, hidden_states=states)
    assert chain.draft_parents is None and chain.draft_token_ids.tolist() == probs.argmax(-1).tolist()
    rows = path_tokens(tree.draft_token_ids.tolist(), tree.draft_parents.tolist())
    zeros = [i for i, q in enumerate(paths) if set(q) == {0}]  # the paths of each head's best: the chain's prefixes
    assert zeros[0] == 0
    for i in zeros:
        assert rows[i + 1] == chain.draft_token_ids[: len(paths[i])].tolist()


def test_a_fixed_tree_deeper_than_the_heads_is_warned_about(target, tmp_path, caplog):
    head = load_medusa(write_medusa(tmp_path / "m", H, V, num_heads=3), target)
    MedusaProposer(head, H, SpeculatorSettings(speculator_path="", medusa_choices="mc_sim_7b_63"))
    assert "2 of its 63 paths are deeper than this head's 3 heads" in caplog.text  # [0,0,0,0] and [0,0,0,1]


def test_a_request_s_tree_top_k_and_tree_depth_narrow_what_its_tree_draws_from(target, tmp_path):
    """A request's tree_top_k and tree_depth: its dynamic tree is drawn from the first tree_depth heads' top
    tree_top_k alone."""
    from spec_decode.proposers.speculators.medusa.tree import dynamic_tree

    head = load_medusa(write_medusa(tmp_path / "m", H, V, num_heads=3), target)
    p = MedusaProposer(head, H, SpeculatorSettings(speculator_path="", speculator_min_token_prob=0.0))
    states = _states(5, seed=4)
    top = torch.topk(torch.softmax(head(states[-1:])[:, 0], -1), 2, dim=-1)
    paths = dynamic_tree([row[:2] for row in top.values.double().tolist()[:2]], 5, 0.0)
    tree = p.propose([ProposalRequest(1, list(range(6)), 5, SamplingParams(), 0, states, tree=True, tree_top_k=2,
                                      tree_depth=2)])[0]
    assert len(paths) == 5 and max(len(q) for q in paths) == 2
    assert tree.draft_token_ids.tolist() == [int(top.indices[len(q) - 1, q[-1]]) for q in paths]
