"""Router collapse: MoE blocks whose routers send most routes to a few experts.

At a learning rate too high for its data (synthetic tokens at the demo's 3e-3, for one), a
block's router can fall onto a few experts and stay there. A capacity plan then drops a large
share of the routes; a dropless plan piles them onto a few experts' GEMMs. Either way the
loss barely moves, and the run says nothing until someone opens ``expert_load.png``.

Early routing is often concentrated too, and recovers on its own: the demo model on the
offline text starts with 2 of 8 experts taking most routes and is balanced by twice its
learning-rate warmup (``tests/test_routing_health.py`` trains both cases). So the watch starts
after ``2 * warmup_steps`` and waits for a collapse to last.

The training loop already reads every block's expert load at its log points (the host read
of the window). :class:`CollapseWatch` turns those reads into one message per block, or a
stop (``TrainConfig.on_router_collapse``), naming the block, what it measured and the knobs.

A block is *concentrated* at a log point when it drops at least :data:`DROPPED` of its routes,
or when its MaxVio (``routing_stats()["max_vio"]``: over the last step's loads summed over its
microbatches and the data-parallel ranks, the busiest expert's load over the mean load, minus 1)
is at least :data:`CONCENTRATED` of the most a top-k router can reach, ``N / top_k - 1`` (every
token on the same ``top_k`` experts): :func:`concentration`. It has *collapsed* once it is
concentrated at :data:`PATIENCE` log points in a row that cover at least :data:`LASTING` steps,
so a noisy window alone never fires.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moec.errors import MoecError

CONCENTRATED = 0.6
DROPPED = 0.4
PATIENCE = 3
LASTING = 50
COLLAPSE_POLICIES = ("warn", "stop", "ignore")


class RouterCollapseError(MoecError):
    """A block's router collapsed and ``TrainConfig.on_router_collapse`` is ``stop``."""


def busiest_share(load: Sequence[int], top_k: int) -> float:
    """Share of a block's routes its ``top_k`` busiest experts take (0 without routes)."""
    return sum(sorted(load, reverse=True)[:top_k]) / max(sum(load), 1)


def concentration(max_vio: float | None, num_experts: int, top_k: int) -> float | None:
    """A block's MaxVio as a share of the most a top-k router can reach (``N / top_k - 1``):
    0 when balanced, 1 when the busiest expert is chosen by every token (as when all routes sit
    on the same ``top_k`` experts). None where it means
    nothing: no MaxVio yet (no finished step), or ``top_k`` covering every expert."""
    if max_vio is None or top_k >= num_experts:
        return None
    return max(0.0, max_vio / (num_experts / top_k - 1))


def _load(stats: Mapping[str, Any]) -> Sequence[int]:
    """The step's global load where there is one, else the last forward's on this rank."""
    return stats.get("step_load") or stats["expert_load"]


def describe(path: str, stats: Mapping[str, Any]) -> str:
    """One block's routing at a log point, as the collapse message gives it."""
    load = _load(stats)
    top_k = stats["top_k"]
    vio = stats.get("max_vio")
    return (
        f"{path}: its {top_k} busiest of {len(load)} experts take "
        f"{100 * busiest_share(load, top_k):.0f}% of the "
        f"routes ({100 * top_k / len(load):.0f}% if balanced)"
        + ("" if vio is None else f", MaxVio {vio:.2f} (at most {len(load) / top_k - 1:g})")
        + f", {100 * stats['drop_rate']:.0f}% dropped"
    )


class CollapseWatch:
    """Watches each MoE block's routing over the log points of a run (see the module doc)."""

    def __init__(
        self,
        policy: str,
        lr: float,
        lbl_coef: float,
        warmup_steps: int,
        balance: str = "microbatch",
        bias_update_rate: float = 1e-3,
    ):
        """``lbl_coef``, ``balance``, ``bias_update_rate``: the plan's (``moe.*``), for the
        message's advice."""
        self.policy, self.lr, self.lbl_coef = policy, lr, lbl_coef
        self.balance, self.bias_update_rate = balance, bias_update_rate
        self.watch_from = 2 * warmup_steps
        self.streaks: dict[str, tuple[int, int]] = {}
        """Block path -> (log points, steps) of its current run of concentrated log points."""
        self.collapsed: dict[str, int] = {}
        """Block path -> the step at which it was found collapsed (each block reported once)."""

    def observe(
        self, step: int, window: int, routing: Mapping[str, Mapping[str, Any]]
    ) -> str | None:
        """Take the routing stats (``CompiledModel.routing_stats()``) of the log point after
        ``step``, which ends a window of ``window`` steps; the message for the blocks found
        collapsed there (None if none), or :class:`RouterCollapseError` under policy ``stop``."""
        if self.policy == "ignore" or step <= self.watch_from:
            return None
        found = []
        for path, stats in routing.items():
            c = concentration(stats.get("max_vio"), len(_load(stats)), stats["top_k"])
            concentrated = stats["drop_rate"] >= DROPPED or (c is not None and c >= CONCENTRATED)
            points, steps = self.streaks.get(path, (0, 0))
            points, steps = (points + 1, steps + window) if concentrated else (0, 0)
            self.streaks[path] = points, steps
            if points >= PATIENCE and steps >= LASTING and path not in self.collapsed:
                self.collapsed[path] = step
                found.append(f"{describe(path, stats)}, concentrated for {steps} steps")
        if not found:
            return None
        message = (
            f"router collapse at step {step}: "
            + "; ".join(found)
            + f". Lower the learning rate (TrainConfig.lr (--lr) = {self.lr:g}), "
            + self._balance_advice()
            + ", or check that the data carries signal (synthetic tokens do not)"
        )
        if self.policy == "stop":
            raise RouterCollapseError(
                message + "; TrainConfig.on_router_collapse (--on-router-collapse) = stop"
            )
        return message

    def _balance_advice(self) -> str:
        if self.balance == "aux_free":
            return (
                f"raise the bias update rate (plan moe.bias_update_rate = "
                f"{self.bias_update_rate:g}, moe.balance = aux_free)"
            )
        return (
            f"raise the load-balancing loss (plan moe.lbl_coef = {self.lbl_coef:g}, "
            f"moe.balance = {self.balance})"
        )
