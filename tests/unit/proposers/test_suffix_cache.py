"""spec_decode.proposers.suffix.cache: the engines, and a request's life in the cache."""

import pytest

from spec_decode.proposers.suffix import SuffixCache, arctic_available

BACKENDS = ["python", "arctic"]


def test_arctic_suffix_tree_is_installed():
    """scripts/build_suffix_tree.sh (run by the set-up) builds Arctic Inference's C++ suffix tree into the venv."""
    assert arctic_available()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_rejects_unknown_requests(backend):
    if backend == "arctic" and not arctic_available():
        pytest.skip("Arctic's suffix tree is not built (test_arctic_suffix_tree_is_installed fails)")
    c = SuffixCache(backend, 8, 2)
    with pytest.raises(ValueError, match="not active"):
        c.speculate(1, [1, 2], 2)
    c.start_request(1, [1, 2])
    with pytest.raises(ValueError, match="already active"):
        c.start_request(1, [1, 2])
