"""Fixtures shared by the integration tests (the server itself is in tests/conftest.py)."""

import json

import pytest
import torch

from client.datasets import humaneval_prompts
from tests.helpers import built_once

N_PROMPTS, N_TOKENS = 5, 64


@pytest.fixture(scope="session")
def greedy_references(tmp_path_factory, request):
    """In-process transformers generate(do_sample=False) of the target alone: (prompt, new ids) for 5 HumanEval
    prompts; computed once per test run (tests/helpers.py ``built_once``)."""

    def generate(folder):
        model, tokenizer = request.getfixturevalue("real_model"), request.getfixturevalue("real_tokenizer")
        refs = []
        for prompt in humaneval_prompts(N_PROMPTS):
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=N_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
            eos = tokenizer.eos_token_id
            refs.append((prompt, out[: out.index(eos)] if eos in out else out))
        folder.mkdir(parents=True)
        (folder / "references.json").write_text(json.dumps(refs))

    folder = built_once(tmp_path_factory, "greedy-references", generate)
    return [tuple(r) for r in json.loads((folder / "references.json").read_text())]
