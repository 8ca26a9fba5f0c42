"""spec_decode.training.speculator: the EAGLE-3 head's training. The tool end to end at a tiny size (real target, a
few steps): an interrupted run resumes where it stopped, its folder is the published EAGLE-3 layout (the names vLLM's
``llama_eagle3.py`` loads) and loads back with the trained logits, its held-out evaluation goes through the serving
proposer; the training-time test's unroll is what live drafting computes; its training windows."""

import json

import pytest
import torch
from safetensors import safe_open

from spec_decode.engine.draft_vocab import DraftVocab
from spec_decode.proposers.eagle import Eagle3Head, Eagle3Proposer, load_eagle3
from spec_decode.proposers.speculators.target import TargetInfo
from spec_decode.training import cli
from spec_decode.training.speculator import depth_weights, main, unrolled_outputs, windows
from spec_decode.training.teacher import Teacher

TINY = ["--eval-prompts", "1", "--eval-tokens", "8", "--stdlib-tokens", "400", "--humaneval-tasks", "3", "--seq-len",
        "48", "--steps", "20", "--batch-size", "4", "--checkpoint-every", "10", "--draft-vocab", "512",
        "--depth", "2"]


def _tiny_head(seed: int = 0, vocab: int = 97, draft: int = 20) -> Eagle3Head:
    torch.manual_seed(seed)
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "intermediate_size": 64, "rms_norm_eps": 1e-5, "draft_vocab_size": draft, "rope_theta": 10000.0}
    model = Eagle3Head(torch.randn(vocab, 32), cfg)
    with torch.no_grad():  # a non-trivial head: its norms away from 1
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _vllm_names(names: set[str]) -> set[str]:
    """The parameters vLLM's ``Eagle3LlamaForCausalLM.load_weights`` (vllm/model_executor/models/llama_eagle3.py)
    fills from a checkpoint's names: ``t2d`` skipped, ``d2t`` -> ``draft_id_to_target_id``, everything but
    ``lm_head`` under ``model.``, ``midlayer.`` -> ``layers.0.``, q/k/v stacked into ``qkv_proj`` and gate/up into
    ``gate_up_proj``."""
    out = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            out.add(name.replace("d2t", "draft_id_to_target_id"))
            continue
        if "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for shard, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                               (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            name = name.replace(shard, stacked)
        out.add(name)
    return out


# Eagle3LlamaForCausalLM's parameters (one draft layer, aux hidden states on, the embedding shipped)
VLLM_PARAMS = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
               "draft_id_to_target_id", "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
               "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
               "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
               "model.layers.0.mlp.down_proj.weight"}


def _interrupt_at(monkeypatch, step: int, seen: list[float]):
    """Make the tool's optimizer steps record their losses and stop the run (as a kill would) before step ``step``."""
    real = cli.optimizer_step

    def optimizer_step(loss, *args):
        if len(seen) == step - 1:
            raise KeyboardInterrupt
        seen.append(loss.item())
        real(loss, *args)

    monkeypatch.setattr(cli, "optimizer_step", optimizer_step)


def test_tool_trains_resumes_and_writes_the_published_eagle3_layout(tmp_path, teacher_cache, real_model_dir,
                                                                   monkeypatch):
    out = tmp_path / "eagle"
    args = ["--output", str(out), "--teacher-cache", str(teacher_cache), *TINY]
    seen: list[float] = []
    _interrupt_at(monkeypatch, 14, seen)  # killed after 13 steps: the checkpoint of step 10 is on disk
    with pytest.raises(KeyboardInterrupt):
        main(args)
    assert len(seen) == 13 and not out.exists()
    monkeypatch.undo()
    assert main(args) == 0  # resumes at step 10
    info = json.loads((out / "train_speculator.json").read_text())
    losses = info["losses"]
    assert len(losses) == 20 and losses[:13] == pytest.approx(seen, rel=1e-4)  # steps 11..13 again, identically
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # the loss falls
    assert len(info["loss_last_per_depth"]) == 2 and info["head"] == "eagle3" and info["aux_layers"] == [2, 15, 27]
    assert info["corpus"]["stdlib_files"] and info["corpus"]["humaneval_tasks"] == 3
    assert {"setup", "corpus", "teacher", "held_out", "vocabulary", "train", "evaluate", "save"} <= set(
        info["phase_minutes"]) and info["within_budget"] in (True, False)
    for ev in info["eval"].values():
        assert 1.0 <= ev["tokens_per_step"] <= 5.0 and ev["steps"] > 0 and len(ev["acceptance_per_position"]) == 4
    assert info["eval"]["every_slot"]["drafts_per_step"] > 0
    assert main(args) == 0  # done: trains nothing
    assert json.loads((out / "train_speculator.json").read_text())["losses"] == losses
    assert len(list(teacher_cache.glob("*/done.json"))) >= 2  # the corpus' pass and the held-out tasks'

    # the published EAGLE-3 layout, as vLLM loads it
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (576, 49152, 512)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t = f.get_tensor("d2t")
    assert _vllm_names(set(shapes)) == VLLM_PARAMS
    assert shapes["fc.weight"] == (576, 3 * 576) and shapes["lm_head.weight"] == (512, 576)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (576, 2 * 576) and shapes["t2d"] == (49152,)
    assert shapes["embed_tokens.weight"] == (49152, 576) and d2t.dtype == torch.int64

    # it loads back (float16 weights) with the trained head's logits
    target = TargetInfo.from_folder(real_model_dir)
    loaded, vocab = load_eagle3(out, target)
    assert len(vocab) == 512 and torch.equal(vocab.token_ids, torch.arange(512) + d2t)
    ck = torch.load(out.with_name("eagle.work") / "checkpoint.pt", weights_only=False)
    trained = Eagle3Head(loaded.embedding, loaded.config)
    trained.load_state_dict({**ck["model"], "embedding": loaded.embedding})
    torch.manual_seed(0)
    wire = torch.randn(1, 6, 4 * 576)
    tokens = vocab.token_ids[torch.randint(512, (1, 6))]
    pos = torch.arange(6)[None]
    with torch.no_grad():
        want = trained.logits(trained(trained.features(wire), tokens, pos))
        got = loaded.logits(loaded(loaded.features(wire), tokens, pos))
    torch.testing.assert_close(got, want, atol=0.05 * float(want.abs().max()), rtol=0.0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8

    # and serves: drafts from [m, 4H] hidden states, probabilities over the target's vocabulary
    from spec_decode.proposers import ProposalRequest
    from spec_decode.sampling import SamplingParams

    proposer = Eagle3Proposer(loaded, vocab, 0.0)
    (p,) = proposer.propose([ProposalRequest(1, [1, 2, 3], 5, SamplingParams(), 0, torch.randn(2, 4 * 576))])
    assert len(p.draft_token_ids) == 5
    assert p.draft_probs.shape == (5, 49152) and torch.allclose(p.draft_probs.sum(-1), torch.ones(5))


def test_the_unroll_is_what_live_drafting_computes():
    """Step d of :func:`unrolled_outputs` at pair j is the state from which the serving proposer drafts its (d+1)-th
    token after committing x_0..x_{j-d+1}, when its earlier drafts were the true tokens."""
    model = _tiny_head()
    vocab = DraftVocab(sorted(torch.randperm(97)[:20].tolist()), 97)
    from spec_decode.proposers import ProposalRequest
    from spec_decode.sampling import SamplingParams

    depth, committed = 4, 7  # x_0..x_6 committed; the proposer drafts x_7..x_10
    torch.manual_seed(1)
    prefix = vocab.token_ids[torch.randint(20, (committed,))].tolist()
    wire = torch.randn(committed + depth, 4 * 32)  # the target's states; those past x_5 are never read
    states: list[torch.Tensor] = []
    real_logits = model.logits

    def logits(state):
        states.append(state.clone())
        return real_logits(state)

    model.logits = logits  # type: ignore[method-assign]
    proposer = Eagle3Proposer(model, vocab, 0.0)
    (p,) = proposer.propose([ProposalRequest(0, prefix, depth, SamplingParams(), 0, wire[: committed - 1])])
    model.logits = real_logits  # type: ignore[method-assign]
    seq = prefix + p.draft_token_ids.tolist()  # greedy drafts: the "true" continuation
    assert len(seq) == committed + depth and len(states) == depth
    t = len(seq) - 1
    with torch.no_grad():
        outs = unrolled_outputs(model, model.features(wire[:t])[None], torch.tensor(seq[1:])[None],
                                torch.arange(t)[None], depth)
    for d in range(depth):
        j = committed - 2 + d  # the last committed pair, n - 1 = committed - 2, drafts the first token
        torch.testing.assert_close(outs[d][0, j], states[d][0], atol=1e-5, rtol=1e-5)
        # and the draft distribution the proposer scattered is the head's there
        want = torch.softmax(model.logits(outs[d][0, j]), -1)
        torch.testing.assert_close(p.draft_probs[d][vocab.token_ids], want, atol=1e-5, rtol=1e-5)


def test_a_trained_layer_s_teacher_forced_pass_is_the_unroll_s_first_step():
    model = _tiny_head(3)
    wire = torch.randn(2, 9, 4 * 32)
    tokens, pos = torch.randint(97, (2, 9)), torch.arange(9).repeat(2, 1)
    with torch.no_grad():
        torch.testing.assert_close(unrolled_outputs(model, model.features(wire), tokens, pos, 1)[0],
                                   model(model.features(wire), tokens, pos))


def test_depth_weights_decay_as_eagle3_s():
    w = depth_weights(3)
    assert w == pytest.approx([1 / 2.44, 0.8 / 2.44, 0.64 / 2.44]) and sum(w) == pytest.approx(1.0)


def test_windows_pair_each_state_with_the_next_token_and_mask_targets_outside_the_vocabulary():
    seqs = [[10, 11, 12, 13, 14, 15], [20, 21, 22]]
    h = 4
    wire = [torch.cat([torch.arange(6.0)[:, None].repeat(1, h), -torch.arange(6.0)[:, None].repeat(1, 3 * h)], 1),
            torch.cat([100 + torch.arange(3.0)[:, None].repeat(1, h), torch.zeros(3, 3 * h)], 1)]
    argmax = [torch.tensor([11, 12, 99, 14, 15, 16], dtype=torch.int32), torch.tensor([21, 22, 23], dtype=torch.int32)]
    teacher = Teacher(argmax, wire, (2, 15, 27))
    kept = torch.zeros(128, dtype=torch.bool)
    kept[10:25] = True  # 99 is outside
    feats, tokens, pos, nxt, mask = next(windows(seqs, teacher, 3, 64, torch.Generator().manual_seed(0), kept))
    assert feats.shape[-1] == 4 * h and nxt.shape[-1] == h
    assert len(set(pos[:, 0].tolist())) > 1  # windows start anywhere
    for b in range(64):
        s = int(pos[b, 0])
        row = 0 if feats[b, 0, 0] < 100 else 1
        n = min(3, len(seqs[row]) - 1 - s)  # pairs up to the last token's predecessor, at most seq_len
        for j in range(n):
            assert torch.equal(feats[b, j], wire[row][s + j]) and nxt[b, j, 0] == wire[row][s + j + 1, 0]
            assert tokens[b, j] == seqs[row][s + j + 1]  # pair j's token x_{s+j+1}, a target id
            # pair j predicts x_{s+j+2}: the target's argmax after position s+j+1 must be a kept token
            assert mask[b, j] == float(int(argmax[row][s + j + 1]) != 99)
        assert (mask[b, n:] == 0).all()


def test_the_step_plan_follows_the_time_left():
    from spec_decode.training.speculator import StepPlan

    plan = StepPlan(400)
    assert not plan.fit(5, 0.02, 10.0) and plan.steps == 400  # 500 more would fit: --steps caps it
    assert plan.fit(10, 0.05, 5.0) and plan.steps == 110  # slower: 100 more
    assert plan.fit(110, 0.05, 4.0) and plan.steps == 190  # more time per step left than feared: grows again
    assert plan.fit(200, 1.0, -1.0) and plan.steps == 200  # out of time: stops at the steps taken
