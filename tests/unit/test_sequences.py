"""spec_decode.sequences: per-sequence state (least recently used out first, eviction reported), common prefixes."""

import pytest

from spec_decode.sequences import SequenceLRU


def test_get_creates_marks_used_and_evicts_the_least_recently_used():
    evicted = []
    lru: SequenceLRU[list] = SequenceLRU(2, lambda sid, v: evicted.append((sid, v)))
    a = lru.get(1, list)
    a.append("a")
    lru.get(2, list)
    assert lru.get(1, list) is a  # a hit returns the same value and marks it used
    lru.get(3, list)  # past the bound: 2 is the least recently used
    assert list(lru) == [1, 3] and evicted == [(2, [])]
    assert lru.peek(1) == ["a"] and lru[3] == [] and 2 not in lru and len(lru) == 2


def test_peek_does_not_mark_used_and_pop_does_not_report_eviction():
    evicted = []
    lru: SequenceLRU[int] = SequenceLRU(2, lambda sid, v: evicted.append(sid))
    lru.put(1, 10)
    lru.put(2, 20)
    assert lru.peek(1) == 10 and lru.peek(9) is None
    lru.put(3, 30)  # 1 was only peeked at: it is still the least recently used
    assert evicted == [1]
    assert lru.pop(2) == 20 and lru.pop(2) is None and evicted == [1]
    assert list(lru.values()) == [30]
    with pytest.raises(KeyError):
        lru[2]


def test_put_of_a_known_id_replaces_it_as_most_recently_used():
    lru: SequenceLRU[str] = SequenceLRU(2)
    lru.put(1, "x")
    lru.put(2, "y")
    lru.put(1, "z")
    lru.put(3, "w")  # evicts 2, not the re-put 1
    assert list(lru) == [1, 3] and lru[1] == "z"


def test_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        SequenceLRU(0)


def test_common_prefix_len():
    from spec_decode.sequences import common_prefix_len

    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([7, 8], [7, 8]) == 2
