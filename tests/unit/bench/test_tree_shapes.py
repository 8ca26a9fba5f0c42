"""bench.tree_shapes: chains against trees of several shapes in process, for a head and for the draft LM, on the
embedded target (random heads; the greedy outputs must agree, which the script checks itself)."""

import json

from bench.tree_shapes import main


def test_head_and_draft_lm_shapes_run_and_keep_the_chain_s_output(published_heads, tmp_path):
    out = tmp_path / "head.json"
    assert main(["--prompts", "1", "--max-tokens", "8", "--nodes", "4", "--min-token-prob", "0", "--shapes",
                 "2x0,4x2", "--speculator-path", str(published_heads["eagle3"]), "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["chain", "top_k 2, depth 0", "top_k 4, depth 2"]
    assert all(r["tokens"] == 8 and not r["differing_prompts"] and r["nodes_per_step"] > 0 for r in rows)
    out = tmp_path / "draft.json"
    assert main(["--method", "draft", "--prompts", "1", "--max-tokens", "8", "--nodes", "4", "--min-token-prob",
                 "0", "--shapes", "3x1.0", "--speculator-path", "none", "--draft-model-path", "default", "--output",
                 str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["tokens_per_step"] > 1 and rows[1]["shape"] == "tree_top_k 3, branch_prob 1"
