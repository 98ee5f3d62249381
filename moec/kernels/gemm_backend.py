"""Which backend runs a grouped GEMM over an expert buffer: the one home of that choice.

:func:`backend` answers for one expert GEMM ``piece``, its operands ``x`` (the row buffer) and
``w`` (the weights, or ``dy`` for ``"wgrad"``), and a :class:`GemmPolicy` (what the
``moec::expert_mlp`` node's bound implementation ``kernels:<policy>`` names; a
:class:`moec.kernels.target.Target` makes it):

- a policy (moec's kernels run these operands: on CUDA, or the interpreter): bf16 on CUDA
  follows the policy's rules (:data:`GEMM_BACKENDS` ``[arch][piece]`` by buffer rows, or one
  forced backend; a backend that does not take the operands passes to the rule before it);
  everything else (float32/16, the interpreter, an arch without a table) runs ``"pointer"``,
  the kernels of :mod:`moec.kernels.grouped_gemm`.
- no policy (the ops' pure-PyTorch path, :mod:`moec.ops.grouped`): ``"grouped_mm"`` where
  :func:`grouped_mm_takes` the operands, else ``"loop"`` (a masked loop over experts).

Backends: ``"cute"`` is the CuTe DSL GEMMs of quack-kernels (:mod:`moec.kernels.cute_gemm`;
optional), a plain activation in quack's epilogue, a gated one on moec's activation kernel;
``"cute_glu"`` the same with the gated activation (and its backward) in quack's epilogues, which
interleaves h's gate and up columns; ``"grouped_mm"`` is ``torch._grouped_mm`` (CUTLASS on
CUDA; an activation then runs on its own kernel), ``"tma"`` the persistent TMA kernel of
:mod:`moec.kernels.grouped_tma`, ``"pointer"`` the pointer-based kernels of
:mod:`moec.kernels.grouped_gemm` (activation fused in the epilogue), ``"loop"`` the ops'
reference. This module imports no Triton, so the ops' path can
ask it on machines without Triton.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from moec.kernels.arch import arch, interpreting

KernelBackend = Literal["cute", "cute_glu", "grouped_mm", "tma", "pointer"]
Backend = Literal[KernelBackend, "loop"]

PIECES = ("up", "down", "dgrad", "dgrad_act", "wgrad")
"""The expert GEMMs: "up" (gmm_act), "down" (gmm), "dgrad" (gmm with transposed weights: the
input gradient of the up projection), "dgrad_act" (gmm_act_backward), "wgrad"."""

Rule = tuple[int, KernelBackend]
"""``(min_rows, backend)``: run ``backend`` on buffers of at least ``min_rows`` rows."""

_SM90_RULES: dict[str, tuple[Rule, ...]] = {
    "up": ((0, "pointer"), (1024, "grouped_mm"), (4096, "cute")),
    "down": ((0, "pointer"), (1024, "grouped_mm"), (4096, "cute")),
    "dgrad": ((0, "pointer"), (1024, "tma"), (4096, "cute")),
    "dgrad_act": ((0, "pointer"), (1024, "grouped_mm"), (4096, "cute")),
    "wgrad": ((0, "pointer"), (1024, "grouped_mm"), (1024, "cute")),
}
GEMM_BACKENDS: dict[str, dict[str, tuple[Rule, ...]]] = {
    "sm90": _SM90_RULES,
    "sm100": _SM90_RULES,
}
"""Per arch and piece (:data:`PIECES`), the rules for bf16 CUDA buffers, by ascending
``min_rows`` (equal ones: a backend and its fallback): the last rule whose ``min_rows`` the
buffer reaches and whose backend takes the
operands runs (``"cute"`` needs quack, ``"cute_glu"`` also a gated activation quack's epilogue
computes, ``"tma"`` TMA-ready operands and never ``"wgrad"``), else ``"pointer"``. The
thresholds are where each backend measured fastest on an H200 (benchmarks/RESULTS.md, "Expert
GEMMs on the CuTe DSL"): the pointer kernels' small-row tiles below 1024 rows,
``torch._grouped_mm`` (TMA for the up projection's dgrad) up to 4096, the CuTe DSL GEMMs from
there and its varlen-K wgrad from 1024 rows (without quack: the rule before). sm100 uses the
sm90 table until measured on its own."""


@dataclasses.dataclass(frozen=True)
class GemmPolicy:
    """Which backend runs each expert GEMM where moec's kernels run: the measured rules of
    :data:`GEMM_BACKENDS` (``forced`` None) or one backend at every size (benchmarks, tests),
    with or without the CuTe DSL (``quack``: quack-kernels may run). A
    :class:`moec.kernels.target.Target` makes it; its :meth:`spec` is what a bound
    ``moec::expert_mlp`` node carries (``"rules+quack"``, ``"rules"``, ``"tma"``...)."""

    quack: bool
    forced: KernelBackend | None = None

    def rules(self, family: str, piece: str) -> tuple[Rule, ...]:
        """The rules for ``piece`` on an arch ``family``."""
        if self.forced is not None:
            return ((0, self.forced),)
        return GEMM_BACKENDS.get(family, {}).get(piece, ())

    def spec(self) -> str:
        """The policy as text, :meth:`parse`'s inverse."""
        if self.forced is not None:
            return self.forced
        return "rules+quack" if self.quack else "rules"

    @classmethod
    def parse(cls, spec: str) -> GemmPolicy:
        """The policy :meth:`spec` wrote; a forced backend runs the CuTe DSL only if it is one."""
        if spec in ("rules", "rules+quack"):
            return cls(quack=spec == "rules+quack")
        if spec not in KERNEL_BACKENDS:
            raise ValueError(
                f"unknown grouped-GEMM policy {spec!r}; known: 'rules', 'rules+quack', "
                f"{', '.join(map(repr, KERNEL_BACKENDS))}"
            )
        return cls(quack=spec in ("cute", "cute_glu"), forced=spec)  # type: ignore[arg-type]


KERNEL_BACKENDS: tuple[str, ...] = ("cute", "cute_glu", "grouped_mm", "tma", "pointer")


@functools.cache
def quack_importable() -> bool:
    """Whether quack-kernels (the CuTe DSL backend, ``moec[cutlass]``) imports."""
    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError:
        return False
    return True


def detected_policy() -> GemmPolicy:
    """The measured rules, with the CuTe DSL where quack imports: the policy of a direct call
    (no bound node)."""
    return GemmPolicy(quack=quack_importable())


def cute_ready(x: Tensor, w: Tensor, quack: bool) -> bool:
    """Whether the CuTe DSL kernels take these operands: ``quack`` (the policy may run it), bf16
    on CUDA sm90+, rows of x and w 16-byte aligned (TMA)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and arch(x.device) in ("sm90", "sm100")
        and x.shape[-1] % 8 == 0
        and w.shape[-1] % 8 == 0
        and w.shape[-2] % 8 == 0
        and quack
    )


def _tma_ready(t: Tensor) -> bool:
    """Unit inner stride, other strides and the base 16-byte aligned (what TMA takes)."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and all((s * size) % 16 == 0 for s in t.stride()[:-1])
        and t.data_ptr() % 16 == 0
    )


def tma_applies(x: Tensor, w: Tensor) -> bool:
    """Whether the TMA kernel takes these operands: sm90+ (or the interpreter), x TMA-ready,
    w TMA-ready as given or as a transposed view."""
    if x.is_cuda:
        if arch(x.device) not in ("sm90", "sm100"):
            return False
    elif not interpreting():
        return False
    return _tma_ready(x) and (_tma_ready(w) or _tma_ready(w.transpose(-1, -2)))


def grouped_mm_takes(piece: str, x: Tensor, w: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``piece`` on these operands, sync-free: bf16 on CUDA
    sm90+; float32/bf16 on the CPU with 16-byte aligned rows (of x, w and, but for ``"wgrad"``,
    w's transpose). Fake float32 is refused: torch's fake ``_grouped_mm`` takes bf16 only."""
    if x.dtype == torch.float32 and is_fake(x):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and arch(x.device) in ("sm90", "sm100")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    operands = (x, w) if piece == "wgrad" else (x, w, w.transpose(-1, -2))
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in operands)


def _takes(
    chosen: KernelBackend, piece: str, x: Tensor, w: Tensor, glu_epilogue: bool, quack: bool
) -> bool:
    if chosen == "cute":
        return cute_ready(x, w, quack)
    if chosen == "cute_glu":
        return glu_epilogue and cute_ready(x, w, quack)
    if chosen == "tma":
        return piece != "wgrad" and tma_applies(x, w)
    return True


def backend(
    piece: str, x: Tensor, w: Tensor, policy: GemmPolicy | None = None, glu_epilogue: bool = False
) -> Backend:
    """The implementation that runs ``piece`` on these operands (see module) under ``policy``
    (moec's kernels; None: the ops' pure-PyTorch path); ``glu_epilogue``: the call has a gated
    activation that quack's epilogue computes, so ``"cute_glu"`` may run."""
    if policy is None:
        return "grouped_mm" if grouped_mm_takes(piece, x, w) else "loop"
    if not x.is_cuda or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return "pointer"
    for min_rows, chosen in reversed(policy.rules(arch(x.device), piece)):
        if x.shape[0] >= min_rows and _takes(chosen, piece, x, w, glu_epilogue, policy.quack):
            return chosen
    return "pointer"


def policy_text(family: str, policy: GemmPolicy | None) -> str:
    """Which backend runs each expert GEMM on an arch ``family`` under ``policy`` (None: the
    ops' reference path) at which buffer sizes, one line per piece (``moec debug`` and the
    benchmarks print it)."""
    if policy is None:
        return (
            "expert GEMMs: the ops' reference path "
            "(torch._grouped_mm where it takes the operands, else a masked loop)"
        )
    quack = "may run" if policy.quack else "off: its rules pass to the rule before"
    lines = [f"expert GEMMs on {family}, bf16 (CuTe DSL {quack}; other dtypes: pointer):"]
    for piece in PIECES:
        rules = policy.rules(family, piece)
        text = ", ".join(f"{chosen} from {rows} rows" for rows, chosen in rules)
        lines.append(f"  {piece:<10} {text or 'pointer'}")
    return "\n".join(lines)
