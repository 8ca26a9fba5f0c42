"""spec_decode.serving.target_model: a round scored in one forward, each row as if alone, a bad row failing alone."""

import numpy as np
import torch

from spec_decode.serving.target_model import TargetBackend
from tests.helpers import step_row


def test_target_backend_batches_rows_and_isolates_errors(tiny_dir):
    """run_batch (what execute() gets from Triton's dynamic batcher): one forward for several sequences, results equal
    to running each alone, a bad row fails alone, a release is answered in the same batch."""
    params = {"model_path": str(tiny_dir), "device": "cpu", "dtype": "float32"}
    alone = TargetBackend(params)
    expected = [alone.run(step_row(1, [5, 6, 7], [8, 9]))["target_probs"],
                alone.run(step_row(2, [1, 2], [3]))["target_probs"]]
    batched = TargetBackend(params)
    calls = []
    score_batch = batched.scorer.score_batch
    batched.scorer.score_batch = lambda items: calls.append(len(items)) or score_batch(items)
    out = batched.run_batch([step_row(1, [5, 6, 7], [8, 9]), step_row(2, [1, 2], [3]), step_row(3, [1, 500]),
                             step_row(4, [1], release=True), step_row(5, [1, 2], temperature=-1.0)])
    assert calls == [2]
    for got, want in zip(out[:2], expected):
        torch.testing.assert_close(got["target_probs"], want, atol=1e-5, rtol=1e-4)
    assert isinstance(out[2], ValueError) and "token ids" in str(out[2])
    assert out[3]["target_probs"].shape == (0, 0)
    assert isinstance(out[4], ValueError) and "'temperature'" in str(out[4])
    assert batched.metrics.get("spec_decode_target_kv_cache_sequences") == 2  # 4 was released, 3 and 5 failed


def test_a_greedy_row_without_log_probs_ships_its_argmax_not_its_distributions(tiny_dir):
    be = TargetBackend({"model_path": str(tiny_dir), "device": "cpu", "dtype": "float32", "max_sequences": "8"})
    greedy, sampled = be.run_batch([step_row(1, [5, 6, 7], [8, 9]),
                                    step_row(2, [5, 6, 7], [8, 9], temperature=np.array([1.0], np.float32))])
    assert tuple(greedy["target_probs"].shape) == (0, 0) and len(greedy["target_argmax"]) == 3
    assert tuple(sampled["target_probs"].shape) == (3, 97) and len(sampled["target_argmax"]) == 0
    # the same ids at temperature 1 without top-k/top-p: the softmax of the same logits, so the same argmax
    probs = torch.as_tensor(sampled["target_probs"])
    assert torch.equal(torch.as_tensor(greedy["target_argmax"]), probs.argmax(-1))
    torch.testing.assert_close(torch.as_tensor(greedy["target_argmax_probs"]), probs.max(-1).values)


def test_each_row_says_what_the_target_reused_and_a_prompt_past_its_share_is_prefilled_in_part(tiny_dir):
    """num_cached_tokens and target_forward_seconds on every row; a row without drafts whose uncached prompt exceeds
    its num_scheduled_tokens computes a chunk of that many tokens and scores nothing (the verifier answers it with no
    token); the next share goes on from the cache; a bad share is refused naming the field."""
    from spec_decode.serving.verifier_model import VerifierBackend

    be = TargetBackend({"model_path": str(tiny_dir), "device": "cpu", "dtype": "float32"})
    prompt = list(range(3, 83))
    share = {"num_scheduled_tokens": np.array([32], np.int32)}
    (chunk,) = be.run_batch([step_row(1, prompt, [], **share)])
    assert tuple(chunk["target_probs"].shape) == (0, 0) and len(chunk["target_argmax"]) == 0
    assert int(chunk["num_cached_tokens"][0]) == 0 and float(chunk["target_forward_seconds"][0]) > 0
    assert be.lm.cached_ids(1) == prompt[:32]
    verifier = VerifierBackend({})
    row = {"target_probs": chunk["target_probs"], "target_argmax": chunk["target_argmax"],
           "target_argmax_probs": chunk["target_argmax_probs"], **{k: v for k, v in step_row(1, prompt, []).items()
                                                                  if k in VerifierBackend.INPUTS}}
    assert len(verifier.run(row)["output_ids"]) == 0
    (second,) = be.run_batch([step_row(1, prompt, [], num_scheduled_tokens=np.array([64], np.int32))])
    assert int(second["num_cached_tokens"][0]) == 32 and len(second["target_argmax"]) == 1  # 48 left: it fits
    (again,) = be.run_batch([step_row(2, prompt, [5, 6], **share)])  # a row with drafts is never cut
    assert len(again["target_argmax"]) == 3 and int(again["num_cached_tokens"][0]) == 64  # prefix cache: 4 pages
    (bad,) = be.run_batch([step_row(3, prompt, [], num_scheduled_tokens=np.array([-1], np.int32))])
    assert isinstance(bad, ValueError) and "num_scheduled_tokens" in str(bad)
