"""Fixtures shared by the integration tests (the server itself is in tests/conftest.py)."""

import pytest
import torch

from client.datasets import humaneval_prompts

N_PROMPTS, N_TOKENS = 5, 64


@pytest.fixture(scope="session")
def greedy_references(real_model, real_tokenizer):
    """In-process transformers generate(do_sample=False) of the target alone: (prompt, new ids) for 5 HumanEval
    prompts."""
    refs = []
    for prompt in humaneval_prompts(N_PROMPTS):
        ids = real_tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = real_model.generate(ids, max_new_tokens=N_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        eos = real_tokenizer.eos_token_id
        refs.append((prompt, out[: out.index(eos)] if eos in out else out))
    return refs
