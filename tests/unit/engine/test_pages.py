"""engine/pages.py: the block manager's page accounting under random growth, rollbacks, sharing and releases."""

import random

import pytest

from spec_decode.engine.pages import TRASH_PAGE, BlockManager, OutOfPages, PagedSequence


def _check(bm: BlockManager, seqs: list[PagedSequence]) -> None:
    held: dict[int, int] = {}
    for s in seqs:
        assert len(s.pages) == -(-len(s.ids) // bm.page_size)
        for p in s.pages:
            held[p] = held.get(p, 0) + 1
    assert TRASH_PAGE not in held
    for p in range(1, bm.num_pages):
        assert bm.ref[p] == held.get(p, 0)  # every reference is a sequence's, and no page is handed out twice
    free = {p for p in range(1, bm.num_pages) if bm.ref[p] == 0} - set(bm._cached)
    assert bm.free_pages() == len(free) + bm.cached_pages()
    assert bm.used_pages() == bm.num_pages - 1 - len(free)


def test_random_growth_rollbacks_sharing_and_releases_keep_the_accounting_exact():
    rng = random.Random(0)
    bm = BlockManager(40, 4)
    seqs = [PagedSequence() for _ in range(5)]
    for _ in range(3000):
        s = rng.choice(seqs)
        op = rng.random()
        try:
            if op < 0.5:  # grow by a step (new ids after a rollback-safe point)
                if bm.writable(s) is not None:
                    pass  # a copy-on-write: the caller would copy the keys; the accounting is what is checked here
                n = len(s.ids) + rng.randint(1, 9)
                bm.grow(s, n)
                s.ids += [rng.randrange(3) for _ in range(n - len(s.ids))]
                bm.register(s)
            elif op < 0.75:
                bm.truncate(s, rng.randint(0, len(s.ids)))
            elif op < 0.85:  # adopt another sequence's full registered pages (a prefix hit)
                other = rng.choice(seqs)
                if other is not s and not s.ids:
                    full = len(other.ids) // bm.page_size
                    for j in range(full):
                        if bm.block_key(other, j) is None:
                            break
                        bm.incref(other.pages[j])
                        s.pages.append(other.pages[j])
                    s.ids = other.ids[: len(s.pages) * bm.page_size]
                    s.registered = len(s.pages)
            else:
                bm.release(s)
        except OutOfPages:
            bm.release(s)
        _check(bm, seqs)
        assert bm._n_free == int(bm._is_free.sum())  # the free count follows the free pages


def test_a_sequence_follows_on_from_its_last_page_and_a_new_one_starts_in_the_middle_of_the_roomiest_free_run():
    bm = BlockManager(65, 16)  # pages 1..64 free
    a, b = PagedSequence(), PagedSequence()
    bm.grow(a, 40)
    assert a.pages == [33, 34, 35]  # the middle of 1..64
    bm.grow(b, 16)
    assert b.pages == [17]  # the middle of 1..32, the longest free run (36..64 is 29 pages)
    bm.grow(a, 100)
    assert a.pages == list(range(33, 40))  # follows on
    bm.release(b)
    bm.grow(b, 40)
    assert b.pages == [17, 18, 19]  # the middle of 1..32 again
    c = PagedSequence()
    bm.grow(c, 16)
    assert c.pages == [52]  # 40..64 is the longest free run now


def test_too_few_pages_is_refused():
    with pytest.raises(ValueError):
        BlockManager(1, 16)
    bm = BlockManager(2, 16)
    bm.allocate()
    with pytest.raises(OutOfPages):
        bm.allocate()
