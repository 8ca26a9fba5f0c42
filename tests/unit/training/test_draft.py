"""The draft distillation tool end to end at a tiny size (real target, a few steps), and the trained draft's use."""

import json

import pytest
import torch

from spec_decode.engine.surgery import truncated_copy
from spec_decode.training.draft import main
from spec_decode.training.teacher import distillation_loss, target_distribution

TINY = ["--eval-prompts", "1", "--eval-tokens", "8", "--stdlib-tokens", "400", "--humaneval-tasks", "3",
        "--corpus-seq-len", "96", "--steps", "14", "--batch-size", "2", "--seq-len", "48", "--layers",
        "1", "--lr", "2e-3", "--checkpoint-every", "7"]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, teacher_cache):
    out = tmp_path_factory.mktemp("draft") / "draft"
    assert main(["--output", str(out), "--teacher-cache", str(teacher_cache), *TINY]) == 0
    return out


def test_truncated_copy_keeps_the_first_layers(tiny_lm):
    draft = truncated_copy(tiny_lm, 1)
    assert draft.config.num_hidden_layers == 1 and len(draft.model.layers) == 1
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, tiny_lm.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(draft.lm_head.weight, tiny_lm.lm_head.weight)
    with pytest.raises(ValueError, match="layers must be in"):
        truncated_copy(tiny_lm, 3)


def test_distillation_loss_is_the_kl_over_the_target_s_top_k_and_zero_for_the_teacher_itself():
    logits = torch.randn(2, 5, 11)
    mask = torch.ones(2, 5)
    assert float(distillation_loss(logits + 3.0, target_distribution(logits), mask)) == pytest.approx(0.0, abs=1e-5)
    student = torch.randn(2, 5, 11)
    p, idx = torch.softmax(logits, -1).topk(4, -1)
    p = p / p.sum(-1, keepdim=True)  # renormalised over the top 4
    kl = (p * (p.log() - torch.log_softmax(student, -1).gather(-1, idx))).sum(-1)
    mask[1, 2:] = 0.0  # masked positions do not count
    assert float(distillation_loss(student, target_distribution(logits, 4), mask)) == pytest.approx(
        float(kl[mask > 0].mean()), rel=1e-5)


def test_tool_runs_end_to_end_loss_falls_and_folder_loads(tiny_draft, real_model_dir):
    from spec_decode.engine.model_loading import load_causal_lm

    info = json.loads((tiny_draft / "train_draft.json").read_text())
    losses = info["losses"]
    assert len(losses) == 14
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # the KL to the target falls
    assert 0.0 <= info["eval"]["top1_agreement"] <= 1.0 and len(info["eval"]["acceptance_per_position"]) == 4
    draft = load_causal_lm(tiny_draft, torch.device("cpu"), torch.float32)
    assert draft.config.num_hidden_layers == 1
    assert (tiny_draft / "tokenizer.json").exists() or (tiny_draft / "tokenizer_config.json").exists()


def test_rerun_resumes_from_the_checkpoint(tiny_draft, teacher_cache):
    before = json.loads((tiny_draft / "train_draft.json").read_text())["losses"]
    # same settings: resumes at the last step, trains nothing
    assert main(["--output", str(tiny_draft), "--teacher-cache", str(teacher_cache), *TINY]) == 0
    after = json.loads((tiny_draft / "train_draft.json").read_text())["losses"]
    assert after == before


def test_greedy_output_with_the_trained_draft_equals_the_target(tiny_draft, real_model, real_tokenizer):
    from spec_decode.engine.draft_vocab import load_draft_vocab
    from spec_decode.engine.kv_cache import CachedCausalLM
    from spec_decode.engine.model_loading import load_causal_lm
    from spec_decode.engine.scorer import TargetScorer
    from spec_decode.generation import Generation
    from spec_decode.in_process import LocalStep, run_local
    from spec_decode.proposers import DraftModelProposer
    from spec_decode.request import GenerationRequest
    from spec_decode.sampling import SamplingParams

    draft = load_causal_lm(tiny_draft, torch.device("cpu"), torch.float32)
    vocab = load_draft_vocab(tiny_draft)
    assert vocab is not None and draft.config.vocab_size == len(vocab) + 1 == 8193
    prompt = "def is_palindrome(s: str) -> bool:\n"
    ids = real_tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        ref = real_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    eos = real_tokenizer.eos_token_id
    ref = ref[: ref.index(eos)] if eos in ref else ref
    proposer = DraftModelProposer(CachedCausalLM(draft), vocab)
    # Sampled proposals: full-vocabulary probabilities, zero outside the kept tokens, drafts among them.
    prop = proposer.propose_one(5, ids, 3, SamplingParams(1.0, 0, 1.0, 7), 0)
    assert prop.draft_probs.shape == (3, vocab.target_vocab_size)
    assert torch.allclose(prop.draft_probs.sum(-1), torch.ones(3), atol=1e-4)
    outside = torch.ones(vocab.target_vocab_size, dtype=torch.bool)
    outside[vocab.token_ids] = False
    assert float(prop.draft_probs[:, outside].abs().sum()) == 0.0
    assert all(int(vocab.to_draft[t]) != vocab.unk_index for t in prop.draft_token_ids.tolist())
    proposer.release(5)
    step = LocalStep({"draft": proposer}, TargetScorer(CachedCausalLM(real_model)))
    gen = Generation(1, ids, GenerationRequest(prompt, 24, speculative_method="draft"), real_tokenizer, [eos], 2048, 0)
    run_local(gen, step)
    assert gen.output_ids == ref
    assert gen.stats.draft_tokens > 0


def test_evaluate_steps_drafts_as_live_greedy_decoding():
    # Draft matches the target at positions 0,1,4,5,6,7,8 of 10: live steps (k = 4) accept 2, 0, 4, 0 drafts.
    from types import SimpleNamespace

    from spec_decode.training.draft import evaluate

    match = [1, 1, 0, 0, 1, 1, 1, 1, 1, 0]
    logits = torch.zeros(1, len(match) + 1, 8)
    for i, m in enumerate(match):
        logits[0, i, 5 if m else 6] = 1.0
    teacher_argmax = torch.full((len(match),), 5, dtype=torch.int32)
    report = evaluate(lambda ids: SimpleNamespace(logits=logits), [list(range(len(match) + 1))], [1],
                      SimpleNamespace(argmax=[teacher_argmax]), k=4)
    assert report["top1_agreement"] == pytest.approx(0.7)
    assert report["live_steps"] == 4
    assert report["live_acceptance_per_position"] == pytest.approx([0.5, 0.5, 0.25, 0.25])
    assert report["live_acceptance_rate"] == pytest.approx(6 / 16)
    assert report["live_tokens_per_step"] == pytest.approx(2.5)


def test_full_vocab_draft_for_assisted_generation_proposes_what_the_served_draft_proposes(tiny_draft, real_model_dir,
                                                                                         real_tokenizer):
    """bench.serving's assisted-generation baseline uses the same draft: its greedy tokens equal the served
    DraftModelProposer's greedy drafts (pruned vocabulary scattered back to the target's)."""
    from bench.serving import full_vocab_draft
    from spec_decode.engine.draft_vocab import load_draft_vocab
    from spec_decode.engine.kv_cache import CachedCausalLM
    from spec_decode.engine.model_loading import load_causal_lm
    from spec_decode.proposers import DraftModelProposer
    from spec_decode.sampling import SamplingParams

    vocab = load_draft_vocab(tiny_draft)
    assert vocab is not None
    full = full_vocab_draft(tiny_draft, vocab.target_vocab_size)
    assert full.config.vocab_size == vocab.target_vocab_size
    served = DraftModelProposer(CachedCausalLM(load_causal_lm(tiny_draft, torch.device("cpu"), torch.float32)), vocab)
    for i, prompt in enumerate(["def add(a, b):\n    return", "for i in range(10):", "import numpy as np\n"]):
        ids = real_tokenizer(prompt)["input_ids"]
        drafts = served.propose_one(i, ids, 5, SamplingParams(), 0).draft_token_ids.tolist()
        with torch.inference_mode():
            out = full.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert out[0, len(ids):].tolist() == drafts
        assert all(t in set(vocab.token_ids.tolist()) for t in drafts)
