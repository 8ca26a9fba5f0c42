"""spec_decode.serving.batching: rows planned alone or into batched calls, one call per group, errors kept apart."""

from spec_decode.serving.batching import Work, run_batched


def test_rows_share_one_call_per_group_and_a_repeated_sequence_waits_for_the_next():
    calls = []

    def plan(row):
        if row["kind"] == "bad":
            raise ValueError(f"bad row {row['seq']}")
        if row["kind"] == "release":
            return {"released": row["seq"]}
        return Work(row["seq"], row["seq"], lambda out: {"out": out}, group=row["kind"])

    def run_group(group, args):
        calls.append((group, list(args)))
        if group == "broken":
            raise RuntimeError("the call failed")
        return [10 * a for a in args]

    rows = [{"seq": 1, "kind": "a"}, {"seq": 2, "kind": "b"}, {"seq": 3, "kind": "a"}, {"seq": 1, "kind": "a"},
            {"seq": 4, "kind": "bad"}, {"seq": 5, "kind": "release"}, {"seq": 6, "kind": "broken"}]
    out = run_batched(rows, plan, run_group)
    assert calls == [("a", [1, 3]), ("b", [2]), ("broken", [6]), ("a", [1])]  # seq 1 twice: a second call
    assert [o["out"] for o in (out[0], out[1], out[2], out[3])] == [10, 20, 30, 10]
    assert isinstance(out[4], ValueError) and out[5] == {"released": 5}
    assert isinstance(out[6], RuntimeError)  # a failing call fails its own rows only
