"""Fixtures of the processors' tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Thousands of tiny forwards: one thread each (two threads spin against each other on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
