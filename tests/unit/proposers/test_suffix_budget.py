"""spec_decode.proposers.suffix: the global tree's token budget (``suffix_max_cached_tokens``), on both engines, and the
memory it bounds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spec_decode.proposers import SuffixProposer, SuffixSettings
from spec_decode.proposers.suffix import SuffixCache, arctic_available

BACKENDS = ["python", "arctic"]
ROOT = Path(__file__).resolve().parents[3]
# Arctic's C++ tree per cached token, as bench.suffix_cache measured it (docs/benchmarks.md, "Suffix decoding's memory")
BYTES_PER_TOKEN = 320


def _skip_unbuilt(backend):
    if backend == "arctic" and not arctic_available():
        pytest.skip("Arctic's suffix tree is not built (test_arctic_suffix_tree_is_installed fails)")


def _response(r: int, length: int) -> list[int]:
    """Response r: tokens no other response has (1000 r + j), so a draft from the global tree tells which it is."""
    return [1000 * (r + 1) + j for j in range(length)]


def _cached(cache: SuffixCache, probe: int, response: list[int]) -> bool:
    """Whether the global tree continues ``response`` (its first two tokens after a token of no response)."""
    cache.start_request(probe, [7])
    draft = cache.speculate(probe, [7, 7] + response[:2], 3, max_spec_factor=4.0)
    cache.stop_request(probe)  # an empty response: nothing joins the global tree
    return draft.token_ids == response[2:5]


def _expected_kept(lengths: list[int], budget: int, max_requests: int) -> list[int]:
    """FIFO reference: the newest responses that fit the budget and the count together (the newest always stays)."""
    kept, total = [], 0
    for r in range(len(lengths) - 1, -1, -1):
        if kept and (total + lengths[r] > budget or len(kept) >= max_requests):
            break
        kept.append(r)
        total += lengths[r]
    return sorted(kept)



def _finish(cache, lengths):
    """Requests 0, 1, ... each with a one-token prompt and a response of ``lengths[r]`` tokens, stopped in order (the
    responses join the global tree)."""
    for r, n in enumerate(lengths):
        cache.start_request(r, [1])
        cache.add_active_response(r, _response(r, n))
        cache.stop_request(r)

@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_tokens_stay_within_the_budget_and_the_oldest_leave_first(backend):
    _skip_unbuilt(backend)
    budget, rng = 120, np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(5, 41, 60)]
    cache = SuffixCache(backend, 16, max_cached_requests=1000, max_cached_tokens=budget)
    for r, n in enumerate(lengths):
        cache.start_request(r, [1, 2, 3])
        cache.add_active_response(r, _response(r, n))
        cache.stop_request(r)
        kept = _expected_kept(lengths[: r + 1], budget, 1000)
        assert cache.cached_tokens() <= budget
        assert cache.cached_tokens() == sum(lengths[i] for i in kept)
        assert cache.cached_requests == len(kept)
        # FIFO: the oldest response still drafted is the reference's oldest kept one; the one before it is gone
        assert _cached(cache, 10_000 + r, _response(kept[0], lengths[kept[0]]))
        if kept[0] > 0:
            assert not _cached(cache, 20_000 + r, _response(kept[0] - 1, lengths[kept[0] - 1]))
    assert _expected_kept(lengths, budget, 1000)[0] > 40  # the 60 responses were far past the budget
    # speculate works on what remains: the kept responses are drafted whole, the evicted ones not at all
    kept = _expected_kept(lengths, budget, 1000)
    for r in range(len(lengths)):
        assert _cached(cache, 30_000 + r, _response(r, lengths[r])) == (r in kept), r
    assert cache.cached_tokens() <= budget


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_request_count_still_bounds_the_tree_beside_the_budget(backend):
    _skip_unbuilt(backend)
    cache = SuffixCache(backend, 16, max_cached_requests=3, max_cached_tokens=1000)
    _finish(cache, [10] * 6)
    assert cache.cached_requests == 3 and cache.cached_tokens() == 30
    assert [_cached(cache, 100 + r, _response(r, 10)) for r in range(6)] == [False] * 3 + [True] * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_response_longer_than_the_budget_keeps_its_last_tokens_alone(backend):
    _skip_unbuilt(backend)
    cache = SuffixCache(backend, 16, max_cached_requests=100, max_cached_tokens=20)
    _finish(cache, [8, 8, 50])
    assert cache.cached_requests == 1 and cache.cached_tokens() == 20
    long = _response(2, 50)
    assert not _cached(cache, 100, long)  # its first 30 tokens were dropped
    assert _cached(cache, 101, long[30:])  # its last 20 are there
    assert not _cached(cache, 102, _response(0, 8)) and not _cached(cache, 103, _response(1, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_token_bound_keeps_every_response(backend):
    _skip_unbuilt(backend)
    cache = SuffixCache(backend, 16, max_cached_requests=100, max_cached_tokens=0)
    _finish(cache, [30] * 20)
    assert cache.cached_requests == 20 and cache.cached_tokens() == 600
    with pytest.raises(ValueError, match="max_cached_tokens"):
        SuffixCache(backend, 16, 100, -1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_proposer_serves_the_budget_and_exports_it(backend):
    _skip_unbuilt(backend)
    p = SuffixProposer(SuffixSettings.from_params({"suffix_backend": backend, "suffix_max_tree_depth": "16",
                                                   "suffix_max_cached_tokens": "50",
                                                   "suffix_max_spec_factor": "4"}))
    for seq in range(10):
        p.speculate(seq, [1, 2], 4)
        p.release(seq, [1, 2] + _response(seq, 12))
        g = p.gauges()
        assert g["spec_decode_suffix_cached_tokens"] <= 50
        assert g["spec_decode_suffix_max_cached_tokens"] == 50
    assert p.gauges()["spec_decode_suffix_cached_responses"] == 4  # 4 x 12 tokens fit in 50
    assert set(p.gauges()) == set(SuffixProposer.GAUGES)
    assert p.speculate(99, [5, 5] + _response(9, 12)[:2], 4).token_ids == _response(9, 12)[2:6]
    assert p.speculate(98, [5, 5] + _response(5, 12)[:2], 4).token_ids == []


def test_the_budget_is_a_checked_setting():
    assert SuffixSettings().max_cached_tokens == 1_000_000
    assert SuffixSettings.from_params({"suffix_max_cached_tokens": "0"}).max_cached_tokens == 0
    with pytest.raises(ValueError, match="suffix_max_cached_tokens"):
        SuffixSettings.from_params({"suffix_max_cached_tokens": "-1"})


# Fills an Arctic-engine cache (max_cached_tokens = budget, 0 = none) with `feed` tokens of random responses of `length`
# tokens, in a process of its own (freed C++ memory is not returned to the OS), and prints the RSS growth in bytes.
_FILL = r"""
import gc, json, sys
import numpy as np
from spec_decode.proposers.suffix import SuffixCache

budget, feed, length = (int(a) for a in sys.argv[1:4])


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


rng = np.random.default_rng(0)
cache = SuffixCache("arctic", 64, max_cached_requests=1 << 30, max_cached_tokens=budget)
gc.collect()
before, worst = rss(), 0
for i in range(feed // length):
    cache.start_request(i, [1, 2, 3])
    cache.add_active_response(i, rng.integers(0, 50000, length).tolist())
    cache.stop_request(i)
    worst = max(worst, cache.cached_tokens())
gc.collect()
print(json.dumps({"growth": rss() - before, "worst_cached_tokens": worst, "cached_tokens": cache.cached_tokens()}))
"""


def _fill(budget: int, feed: int, length: int) -> subprocess.Popen:
    """Start :data:`_FILL` in its own process (its JSON: :func:`_result`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "backend_src"), str(ROOT)])}
    return subprocess.Popen([sys.executable, "-c", _FILL, str(budget), str(feed), str(length)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not arctic_available(), reason="Arctic's suffix tree is not built")
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the RSS from /proc")
def test_the_budget_bounds_the_arctic_trees_memory():
    """20 x the budget of random responses: RSS growth within budget x bytes per token x 2 + 8 MiB; without the bound
    the same feed grows well past that, so the check can fail. The two fills run side by side, each in its own
    process (~10 s on 2 cores)."""
    budget, length = 20_000, 500
    feed = 20 * budget
    allowance = budget * BYTES_PER_TOKEN * 2 + 8 * 2**20
    procs = [_fill(budget, feed, length), _fill(0, feed, length)]
    bounded, unbounded = (_result(p) for p in procs)
    assert bounded["worst_cached_tokens"] <= budget and bounded["cached_tokens"] > budget - length
    assert bounded["growth"] <= allowance, bounded
    assert unbounded["cached_tokens"] == feed
    assert unbounded["growth"] > 2 * allowance, unbounded
