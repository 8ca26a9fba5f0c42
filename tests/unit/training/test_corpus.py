"""spec_decode.training.corpus: deterministic training text from the standard library and HumanEval's training tasks."""

import pytest

from spec_decode.training.corpus import HELD_OUT, heldout_tasks, stdlib_files, training_corpus


def test_the_corpus_is_deterministic_bounded_and_leaves_the_held_out_tasks_out(real_tokenizer):
    files = stdlib_files()
    assert len(files) > 300 and not any("/test/" in f.as_posix() or "/tests/" in f.as_posix() for f in files)
    a = training_corpus(real_tokenizer, 3000, seq_len=64, seed=0, humaneval_tasks=5)
    b = training_corpus(real_tokenizer, 3000, seq_len=64, seed=0, humaneval_tasks=5)
    c = training_corpus(real_tokenizer, 3000, seq_len=64, seed=1, humaneval_tasks=5)
    assert a.sequences == b.sequences and a.files == b.files and a.files != c.files
    stdlib = [s for s, src in zip(a.sequences, a.sources) if src.startswith("stdlib:")]
    assert sum(len(s) for s in stdlib) == 3000 and max(len(s) for s in a.sequences) <= 64
    tasks = [src for src in a.sources if src.startswith("humaneval:")]
    held = {t["task_id"] for t in heldout_tasks(HELD_OUT)}
    assert len(tasks) == 5 and not {t.split(":", 1)[1] for t in tasks} & held
    with pytest.raises(ValueError, match="seq_len"):
        training_corpus(real_tokenizer, 10, seq_len=1)
