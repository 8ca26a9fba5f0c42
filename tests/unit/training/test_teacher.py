"""spec_decode.training.teacher: the target's hidden states and argmax, as its own forward computes them; the
distillation targets its LM head reads from them; the disk cache resumes and serves both tools; the dtype of the
corpus' pass."""

import pytest
import torch

from spec_decode.training.cli import HelpFormatter, publish
from spec_decode.training.teacher import cached_teacher, target_logits, teacher_dtype, teacher_pass


def test_teacher_pass_equals_the_model_s_forward_at_every_position(tiny_lm):
    seqs = [[5, 6, 7, 8, 9, 10], [1, 2], [40, 41, 42, 43]]
    t = teacher_pass(tiny_lm, seqs, batch_tokens=8, progress=False)
    head = tiny_lm.get_output_embeddings().weight.detach()
    for s, top, hid in zip(seqs, t.argmax, t.hidden):
        with torch.inference_mode():
            out = tiny_lm(torch.tensor([s]), output_hidden_states=True)
        assert torch.equal(top.long(), out.logits[0].argmax(-1)) and hid.shape == (len(s), 32)
        torch.testing.assert_close(hid.float(), out.hidden_states[-1][0], atol=2e-3, rtol=1e-3)  # float16
        # the LM head over the states is the model's own next-token logits (over any kept subset of tokens)
        torch.testing.assert_close(target_logits(hid.float(), head), out.logits[0], atol=2e-2, rtol=1e-3)
        kept = torch.tensor([3, 17, 40])
        torch.testing.assert_close(target_logits(hid.float(), head[kept]), out.logits[0][:, kept], atol=2e-2,
                                   rtol=1e-3)


def test_the_cache_resumes(tiny_lm, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_lm.save_pretrained(model_dir)
    seqs = [[i, i + 1, i + 2] for i in range(10)]
    full = cached_teacher(tiny_lm, model_dir, seqs, tmp_path / "cache", shard=4)
    (folder,) = [p.parent for p in (tmp_path / "cache").glob("*/done.json")]
    assert len(list(folder.glob("shard-*.pt"))) == 3
    (folder / "done.json").unlink()
    (folder / "shard-00001.pt").unlink()  # interrupted: two shards kept
    calls = []
    import spec_decode.training.teacher as teacher

    real = teacher.teacher_pass
    teacher.teacher_pass = lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw)
    try:
        again = cached_teacher(tiny_lm, model_dir, seqs, tmp_path / "cache", shard=4)
        assert calls == [4]  # only the missing shard was computed
        cached_teacher(tiny_lm, model_dir, seqs, tmp_path / "cache", shard=4)
        assert calls == [4]  # done: loaded
    finally:
        teacher.teacher_pass = real
    assert all(torch.equal(a, b) for a, b in zip(full.argmax, again.argmax))
    assert all(torch.equal(a, b) for a, b in zip(full.hidden, again.hidden))


def test_teacher_dtype_names():
    assert teacher_dtype("float32") == torch.float32 and teacher_dtype("bfloat16") == torch.bfloat16
    assert teacher_dtype("auto") in (torch.float32, torch.bfloat16)
    assert teacher_dtype("auto", torch.device("cuda")) == torch.bfloat16  # the device the pass runs on decides
    with pytest.raises(ValueError, match="auto, float32 or bfloat16"):
        teacher_dtype("float16")


def test_publish_replaces_the_folder_whole_and_leaves_nothing_aside(tmp_path):
    out, tmp = tmp_path / "head", tmp_path / "head.tmp"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    publish(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "head"]
    (tmp_path / "again").mkdir()
    publish(tmp_path / "again", tmp_path / "fresh")  # no older folder
    assert (tmp_path / "fresh").is_dir() and not (tmp_path / "again").exists()


def test_help_shows_the_defaults_of_set_options_only():
    import argparse

    ap = argparse.ArgumentParser(formatter_class=HelpFormatter)
    ap.add_argument("--steps", type=int, default=380, help="optimizer steps")
    ap.add_argument("--output", default=None, help="head folder")
    ap.add_argument("--fresh", action="store_true", help="start over")
    text = " ".join(ap.format_help().split())
    assert "optimizer steps (default: 380)" in text and "head folder --fresh" in text and "start over" in text
    assert text.count("(default:") == 1
