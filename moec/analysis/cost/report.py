"""Cost reports: a graph's cost evaluated at concrete sizes, as plain numbers, and their text.

:class:`CostReport` is what :meth:`GraphCost.evaluate <moec.analysis.cost.GraphCost.evaluate>`
returns (JSON-ready through :meth:`CostReport.to_dict`); :func:`format_count` writes counts for
tables and summary lines.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass
class CostReport:
    """A :class:`~moec.analysis.cost.GraphCost` evaluated at concrete sizes."""

    sizes: dict[str, int]
    tokens: int
    flops: int
    matmul_flops: int
    train_flops: int
    bytes_out: int
    saved_bytes: int
    params: int
    active_params: int
    blocks: list[dict[str, Any]]

    @property
    def flops_per_token(self) -> float:
        return self.flops / max(self.tokens, 1)

    @property
    def train_flops_per_token(self) -> float:
        return self.train_flops / max(self.tokens, 1)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["flops_per_token"] = self.flops_per_token
        data["train_flops_per_token"] = self.train_flops_per_token
        return data


def format_count(value: float) -> str:
    """``1234567`` -> ``1.23M`` (for tables and summary lines)."""
    if value == 0:
        return "0"
    exponent = min(int(math.log10(abs(value)) // 3), 5)
    return f"{value / 1000**exponent:.3g}{['', 'K', 'M', 'G', 'T', 'P'][exponent]}"
