"""spec_decode.teacher: the target's top-k distributions and hidden states, as its own forward computes them; the
disk cache resumes and serves both tools."""

import torch

from spec_decode.teacher import cached_teacher, teacher_pass


def test_teacher_pass_equals_the_model_s_forward_at_every_position(tiny_lm):
    seqs = [[5, 6, 7, 8, 9, 10], [1, 2], [40, 41, 42, 43]]
    t = teacher_pass(tiny_lm, seqs, top_k=4, with_hidden=True, batch_tokens=8, progress=False)
    for s, lp, idx, hid in zip(seqs, t.top_logp, t.top_idx, t.hidden):
        with torch.inference_mode():
            out = tiny_lm(torch.tensor([s]), output_hidden_states=True)
        ref_lp, ref_idx = torch.log_softmax(out.logits[0], -1).topk(4, -1)
        assert torch.equal(idx.long(), ref_idx) and lp.shape == (len(s), 4)
        torch.testing.assert_close(lp.float(), ref_lp, atol=2e-3, rtol=1e-3)  # float16
        torch.testing.assert_close(hid.float(), out.hidden_states[-1][0], atol=2e-3, rtol=1e-3)


def test_the_cache_resumes_and_a_pass_with_hidden_states_serves_one_without(tiny_lm, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_lm.save_pretrained(model_dir)
    seqs = [[i, i + 1, i + 2] for i in range(10)]
    full = cached_teacher(tiny_lm, model_dir, seqs, tmp_path / "cache", top_k=3, with_hidden=True, shard=4)
    (folder,) = [p.parent for p in (tmp_path / "cache").glob("*/done.json")]
    assert len(list(folder.glob("shard-*.pt"))) == 3
    (folder / "done.json").unlink()
    (folder / "shard-00001.pt").unlink()  # interrupted: two shards kept
    calls = []
    import spec_decode.teacher as teacher

    real = teacher.teacher_pass
    teacher.teacher_pass = lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw)
    try:
        again = cached_teacher(tiny_lm, model_dir, seqs, tmp_path / "cache", top_k=3, with_hidden=True, shard=4)
        assert calls == [4]  # only the missing shard was computed
        plain = cached_teacher(tiny_lm, model_dir, seqs, tmp_path / "cache", top_k=3, shard=4)
        assert calls == [4] and plain.hidden is None  # served by the pass with hidden states
    finally:
        teacher.teacher_pass = real
    for a, b in zip(full.top_idx, again.top_idx):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(full.top_idx, plain.top_idx))
