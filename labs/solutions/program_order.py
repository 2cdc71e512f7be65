"""Lab 14, solution: start a causal backward's heaviest programs first.

A causal backward's dK/dV kernel runs one program per (K/V tile, batch·head), and their work is not
equal: the program of the first K/V tile meets every query tile of its head, the last one only the
tiles on the diagonal (a query sees only the keys up to its own). The GPU hands programs to its SMs in
launch order, one at a time per SM here (these kernels fill an SM's shared memory), each SM taking the
next program the moment its last one ends. So the order decides when the last program ends: launched
one head after another, the last programs handed out are the heaviest tiles of the last heads, and the
SMs that drew light tiles early wait for them. Grouped-query attention makes it worse, since each
program then walks the Q tiles of every query head of its group: fewer, longer programs.

Your job, marked ``TODO(lab)``:

* ``makespan(work, sms)``: when the last program ends if ``work`` (one duration per program, in launch
  order) runs that way on ``sms`` SMs, all free at time 0.
* ``launch_order(work, sms)``: an order of every program, given ``work[h][t]`` (the duration of K/V tile
  ``t`` of batch·head ``h``, as ``causal_dkdv_work`` builds it), that ends no later than 2 % after the
  check's own good order does.

The check compares ``makespan`` with its own on random durations, then draws causal problems at random
(1-128 batch·heads, sequences up to 16k, groups of 1-8 query heads, 16-132 SMs) and times your order
with its own ``makespan``; the one-head-after-another order fails there. Nothing under ``stages/`` may
run while your functions do.

Past the lab: the order also decides which programs run side by side, and programs of one head share
its Q and dO tiles in L2. Stage C's forward lost a third of its speed to longest-first across every head
for that reason, and won it back with pairs of a head's longest and shortest row blocks (performance
log, scheduling, entries 7 and 10). The backward found the same: heavy tiles first across every head read
twice cuDNN's bytes from DRAM, and heavy tiles first within small groups of heads, one group after
another, read cuDNN's. ``stages/c_optimized/hopper_bwd.py`` has the backward's orders
(``LAB_BWD_HEAVY_FIRST``, ``LAB_BWD_HEAD_GROUP``; by default the smallest groups the model still balances)
and ``experiments/program_order.py`` times them (backward, entries 75, 76 and 85).

    python -m labs check program_order
"""

from __future__ import annotations

import heapq


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def causal_dkdv_work(heads: int, N: int, group: int = 1, kv_rows: int = 128, q_rows: int = 64) -> list[list[int]]:
    """``work[h][t]``: Q tiles the program of K/V tile ``t`` of batch·head ``h`` multiplies, causal,
    Nq = Nk = N: the tile's keys start at ``t * kv_rows``, so it meets the Q tiles from that row on,
    for each of the ``group`` query heads that share the K/V head."""
    return [[group * cdiv(N - t * kv_rows, q_rows) for t in range(cdiv(N, kv_rows))] for _ in range(heads)]


def makespan(work: list[float], sms: int) -> float:
    """The end of the last program when ``work`` runs in this order, each SM taking the next program
    as soon as it is free."""
    # A heap of when each SM is next free: the next program goes to the earliest, and ends its
    # duration later. The last end is the makespan (list scheduling, Graham 1966).
    free = [0.0] * sms
    for w in work:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)


def launch_order(work: list[list[float]], sms: int) -> list[tuple[int, int]]:
    """Every (tile, batch·head) once, in the order to launch them."""
    # Longest first (Graham's LPT rule, 1969): what is left at the end are the short programs, which fill
    # the SMs' last gaps instead of starting a long one alone. Within equal work (a tile of every
    # head) the heads follow one another, as in the kernels' chunked order with a chunk of one tile.
    programs = [(t, h) for h in range(len(work)) for t in range(len(work[h]))]
    return sorted(programs, key=lambda p: (-work[p[1]][p[0]], p[0], p[1]))
