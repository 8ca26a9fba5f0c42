"""spec_decode.training.speculator: the tool end to end at a tiny size (real target, a few steps), resumable; its
held-out evaluation through the serving proposer; its training windows."""

import json

import torch

from spec_decode.engine.draft_vocab import DraftVocab
from spec_decode.training.speculator import main, windows
from spec_decode.training.teacher import Teacher

TINY = ["--eval-prompts", "1", "--eval-tokens", "8", "--stdlib-tokens", "400", "--humaneval-tasks", "3", "--seq-len",
        "48", "--steps", "20", "--batch-size", "4", "--checkpoint-every", "10", "--draft-vocab", "512",
        "--depth", "2"]


def test_tool_runs_end_to_end_resumes_and_its_folder_serves(tmp_path, teacher_cache, real_model_dir):
    from spec_decode.proposers import EagleProposer, EagleSettings, ProposalRequest
    from spec_decode.sampling import SamplingParams

    out = tmp_path / "eagle"
    assert main(["--output", str(out), "--teacher-cache", str(teacher_cache), *TINY]) == 0
    info = json.loads((out / "train_speculator.json").read_text())
    losses = info["losses"]
    assert len(losses) == 20 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # the loss falls
    assert len(info["loss_last_per_depth"]) == 2
    assert info["corpus"]["stdlib_files"] and info["corpus"]["humaneval_tasks"] == 3
    for ev in info["eval"].values():
        assert 1.0 <= ev["tokens_per_step"] <= 5.0 and ev["steps"] > 0 and len(ev["acceptance_per_position"]) == 4
    assert info["eval"]["every_slot"]["drafts_per_step"] > 0
    assert main(["--output", str(out), "--teacher-cache", str(teacher_cache), *TINY]) == 0  # resumes: trains nothing
    assert json.loads((out / "train_speculator.json").read_text())["losses"] == losses
    assert len(list(teacher_cache.glob("*/done.json"))) >= 2  # the corpus' pass and the held-out tasks'

    proposer = EagleProposer.from_config(EagleSettings(eagle_path=str(out), eagle_min_token_prob=0.0), {})
    (p,) = proposer.propose([ProposalRequest(1, [1, 2, 3], 5, SamplingParams(), 0, torch.randn(2, 576))])
    assert len(p.draft_token_ids) == 5
    assert p.draft_probs.shape == (5, 49152) and torch.allclose(p.draft_probs.sum(-1), torch.ones(5))


def test_windows_pair_each_state_with_the_next_token_and_the_next_position_s_targets():
    seqs = [[10, 11, 12, 13, 14, 15], [20, 21, 22]]
    hidden = [torch.arange(6.0)[:, None].repeat(1, 4), 100 + torch.arange(3.0)[:, None].repeat(1, 4)]
    teacher = Teacher([torch.tensor(s, dtype=torch.int32) + 1 for s in seqs], hidden)
    vocab = DraftVocab(list(range(10, 25)), 30)
    feats, tokens, pos, nxt, mask = next(windows(seqs, teacher, 3, 64, torch.Generator().manual_seed(0), vocab))
    assert len(set(pos[:, 0].tolist())) > 1  # windows start anywhere
    for b in range(64):
        n = int(mask[b].sum())
        s = int(pos[b, 0])
        row = 0 if feats[b, 0, 0] < 100 else 1
        assert n == min(3, len(seqs[row]) - 1 - s)  # pairs up to the last token's predecessor, at most seq_len
        for j in range(n):
            assert feats[b, j, 0] == hidden[row][s + j, 0] and nxt[b, j, 0] == hidden[row][s + j + 1, 0]
            assert vocab.token_ids[tokens[b, j]] == seqs[row][s + j + 1]  # pair j's token x_{s+j+1}
        assert (mask[b, n:] == 0).all()
