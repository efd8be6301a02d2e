"""FreeList: first fit, coalescing, idle exactly when everything was given back."""

from __future__ import annotations

import random

from tetriinfer.transfer.freelist import FreeList


def test_first_fit_and_coalescing() -> None:
    fl = FreeList(100)
    a, b, c = fl.take(30), fl.take(30), fl.take(30)
    assert (a, b, c) == (0, 30, 60)
    assert fl.take(20) is None  # only 10 bytes left
    fl.give(b, 30)
    assert fl.take(40) is None  # 30 + 10 are not adjacent
    fl.give(a, 30)  # merges with b's span -> one 60-byte span at 0
    assert fl.spans == [(0, 60), (90, 10)]
    fl.give(c, 30)
    assert fl.idle and fl.spans == [(0, 100)]


def test_random_take_give_conserves_bytes() -> None:
    rng = random.Random(7)
    fl = FreeList(1 << 16)
    held: list[tuple[int, int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            off, n = held.pop(rng.randrange(len(held)))
            fl.give(off, n)
        else:
            n = rng.randint(1, 4096)
            off = fl.take(n)
            if off is not None:
                assert all(off + n <= o or o + m <= off for o, m in held)  # never overlaps a held range
                held.append((off, n))
        free = sum(n for _, n in fl.spans)
        assert free + sum(n for _, n in held) == fl.size
        assert all(fl.spans[i][0] + fl.spans[i][1] < fl.spans[i + 1][0] for i in range(len(fl.spans) - 1))
    for off, n in held:
        fl.give(off, n)
    assert fl.idle
