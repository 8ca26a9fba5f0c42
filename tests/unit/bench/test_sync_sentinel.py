"""bench.gpu_check.sync_sentinel: on a CPU, what in a served round would make the host wait for the GPU.

The sentinel follows the tensors that would live on the device and records each host read of one; over warm rounds of
the served backends it finds where a round synchronises. A plain round reads the device twice: the verifier's one
copy of every row's argmax ids and probabilities, and the outputs that travel back to generate. A model proposer's
drafting loop reads once per slot for the whole batch (its confidence rule runs on the host). Each read is named by
function, so a new one anywhere fails this test, naming it."""

from __future__ import annotations

import torch

from bench.gpu_check.sync_sentinel import SyncSentinel


def test_the_sentinel_follows_device_tensors_and_records_host_reads():
    w = torch.nn.Parameter(torch.randn(4, 3))
    host = torch.randn(3)
    sentinel = SyncSentinel([w])
    with torch.inference_mode(), sentinel:
        y = w[1] * 2  # derived from a device tensor: on the device
        assert sentinel.on_device(y) and not sentinel.on_device(host)
        float(host[0]), host.tolist()  # host tensors: nothing recorded
        assert not sentinel.events
        float(y[0])
        y.nonzero()
        torch.repeat_interleave(y.long().abs(), torch.tensor([1, 1, 1]), output_size=3)  # told its size: no wait
        y.cpu().numpy()  # one copy
        y.tolist()
        out = torch.full((2, 3), -1.0)
        out[0, :3] = y  # written through a view: the buffer holds device data now
        assert sentinel.on_device(out)
    assert [e.what for e in sentinel.events] == ["item", "nonzero", "cpu", "tolist"]
    assert all(e.function.endswith("test_sync_sentinel.py:test_the_sentinel_follows_device_tensors_and_records_"
                                   "host_reads") for e in sentinel.events)
    y.tolist()  # the sentinel is off: Tensor methods restored
    assert len(sentinel.events) == 4


def test_served_rounds_read_the_device_only_where_known(tmp_path):
    from bench.gpu_check.context import Context
    from bench.gpu_check.decoding import build_models, load_ensembles, make_prompts
    from bench.gpu_check.sync_sentinel import round_syncs

    ctx = Context.for_device("cpu")
    built = build_models(ctx, tmp_path)
    ens = load_ensembles(ctx, built["paths"], "float32", with_self=False)
    got = round_syncs(ens, make_prompts(2, 24, ctx.sizes.llama["vocab_size"]), cuda=False)
    one_copy = {"cpu backend_src/spec_decode/serving/verifier_model.py:argmax_to_host",
                "cpu backend_src/spec_decode/serving/local_ensemble.py:_host"}
    # a plain round: the verifier's one copy and the outputs that go back to generate, for the whole batch
    assert got["plain"]["by_function"] == dict.fromkeys(one_copy, 1)
    # a drafted chain (k = 4, every slot drafted): one read per drafting slot for the whole batch (its tokens,
    # confidence and probabilities together), then the plain round's two
    per_slot = "cpu backend_src/spec_decode/proposers/base.py:slot_outcomes"
    for kind in ("head chain, greedy", "draft LM chain, greedy"):
        assert got[kind]["by_function"] == {**dict.fromkeys(one_copy, 1), per_slot: 4}, kind
    # sampled: the slots' reads, the coupled race's tokens once, the emitted ids and log-probabilities once
    assert got["head chain, sampled"]["by_function"] == {
        per_slot: 4, "cpu backend_src/spec_decode/verifier/rejection.py:coupled_sample": 1,
        "cpu backend_src/spec_decode/verifier/verifier.py:_emitted": 1,
        "cpu backend_src/spec_decode/serving/local_ensemble.py:_host": 1}
