"""Fixtures of the step models' tests."""

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tiny_lm, tmp_path_factory):
    """The tiny random Llama saved as a model folder."""
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    tiny_lm.save_pretrained(path)
    return path
