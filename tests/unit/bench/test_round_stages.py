"""bench.round_stages: the per-round stage arithmetic over two counter snapshots."""

import pytest

from bench.round_stages import GENERATE_STAGES, STEP_MODELS, breakdown


def _snapshot(scale: float) -> dict[str, float]:
    s = {"rounds": 10 * scale}
    for stage in GENERATE_STAGES:
        s[f"generate.{stage}"] = 0.001 * scale
    s["generate.ensemble"] = 0.5 * scale
    for m in (*STEP_MODELS, "spec_step", "score_step"):
        s[f"{m}.request_us"] = 1e5 * scale
        s[f"{m}.execute_us"] = 9e4 * scale
        s[f"{m}.requests"] = 12 * scale  # 2 of them (releases) batched with a round's request: 10 executions
        s[f"{m}.executions"] = 10 * scale
    for m in STEP_MODELS:
        s[f"{m}.work"] = 0.05 * scale
        s[f"{m}.decode_inputs"] = s[f"{m}.encode_outputs"] = 0.002 * scale
    return s


def test_breakdown_is_milliseconds_per_round_of_what_moved():
    out = breakdown(_snapshot(1), _snapshot(3), seconds=2.0)
    assert out["rounds"] == 20
    assert out["round (client wall time)"] == pytest.approx(100.0)
    assert out["generate: ensemble"] == pytest.approx(50.0)  # 1.0 s over 20 rounds
    # 2e5 us over 24 requests in 20 executions: 1/6 of it counted twice
    assert out["target_model: Triton request"] == pytest.approx(10.0 * 20 / 24)
    # the BLS call (1.0 s) less the three models' executes (3 x 1.8e5 us x 20 / 24 = 0.45 s)
    assert out["Triton outside the models' execute (BLS call less them)"] == pytest.approx(27.5)
    # wall 2.0 s less target and proposer work (0.1 s each)
    assert out["non-forward time (wall less target and proposer work)"] == pytest.approx(90.0)


def test_breakdown_refuses_a_load_without_rounds():
    with pytest.raises(RuntimeError, match="no round"):
        breakdown(_snapshot(1), _snapshot(1), seconds=1.0)
