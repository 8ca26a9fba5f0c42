"""spec_decode.train_speculator: the tool end to end at a tiny size (real target, a few steps), resumable; its
held-out evaluation."""

import json

import torch

from spec_decode.train_speculator import main

TINY = ["--eval-prompts", "1", "--eval-tokens", "8", "--stdlib-tokens", "400", "--humaneval-tasks", "3", "--seq-len",
        "96", "--top-k", "8", "--steps", "20", "--batch-size", "16", "--checkpoint-every", "10", "--draft-vocab", "512",
        "--n-predict", "3"]


def test_tool_runs_end_to_end_resumes_and_its_folder_serves(tmp_path, teacher_cache, real_model_dir):
    from spec_decode.proposers import MLPSpeculatorProposer, MLPSpeculatorSettings, ProposalRequest
    from spec_decode.sampling import SamplingParams

    out = tmp_path / "spec"
    assert main(["--output", str(out), "--teacher-cache", str(teacher_cache), *TINY]) == 0
    info = json.loads((out / "train_speculator.json").read_text())
    losses = info["losses"]
    assert len(losses) == 20 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # the KL to the target falls
    assert info["corpus"]["stdlib_files"] and info["corpus"]["humaneval_tasks"] == 3
    ev = info["eval"]
    assert len(ev["stage_agreement"]) == 3 and 1.0 <= ev["live_tokens_per_step"] <= 4.0 and ev["live_steps"] > 0
    assert main(["--output", str(out), "--teacher-cache", str(teacher_cache), *TINY]) == 0  # resumes: trains nothing
    assert json.loads((out / "train_speculator.json").read_text())["losses"] == losses
    assert len(list(teacher_cache.glob("*/done.json"))) >= 2  # the corpus' pass and the held-out tasks'

    proposer = MLPSpeculatorProposer.from_config(MLPSpeculatorSettings(mlp_speculator_path=str(out),
                                                                       mlp_speculator_min_token_prob=0.0), {})
    hidden = torch.randn(2, 576)
    (p,) = proposer.propose([ProposalRequest(1, [1, 2, 3], 5, SamplingParams(), 0, hidden)])
    assert len(p.draft_token_ids) == 3  # at most n_predict
    assert p.draft_probs.shape == (3, 49152) and torch.allclose(p.draft_probs.sum(-1), torch.ones(3))
