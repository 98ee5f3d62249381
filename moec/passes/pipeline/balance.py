"""Balance: contiguous units per stage minimising the most expensive stage.

:func:`balance` assigns units (blocks or half blocks) to ``S`` stages in order by exact dynamic
programming over prefixes, minimising lexicographically (the most expensive stage's cost, e.g.
its predicted forward seconds, then its predicted peak activation bytes: ``in_flight[s]`` times
the units' kept bytes per microbatch, plus the largest transient of recomputing one of them).
With a heavy LM head in the last unit's cost this gives the last stage fewer units.
"""

from __future__ import annotations


def balance(
    cost: list[float], saved: list[tuple[int, int]], num_stages: int, in_flight: list[int]
) -> list[int]:
    """Start index of every stage (contiguous units) minimising (max stage cost, max stage
    predicted activation bytes); ``saved`` holds (kept, transient) bytes per unit."""
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> tuple[float, int]:
        kept = sum(k for k, _ in saved[i:j])
        transient = max(t for _, t in saved[i:j])
        return prefix[j] - prefix[i], in_flight[s] * kept + transient

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                f, m = stage_cost(s - 1, i, j)
                cand = (max(best[s - 1][i][0], f), max(best[s - 1][i][1], m))
                if cand < best[s][j]:
                    best[s][j], choice[s][j] = cand, i
    starts, j = [], n
    for s in range(num_stages, 0, -1):
        j = choice[s][j]
        starts.append(j)
    return starts[::-1]
