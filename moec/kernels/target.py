"""What a program is compiled for: the device architecture and the backends installed there.

A :class:`Target` is what pass ``bind`` (:mod:`moec.passes.bind`) binds each ``moec::`` node's
implementation against. :meth:`Target.detect` reads it from the machine (the device the program
runs on, what imports); benchmarks and tests build one instead (``Target.detect(device)`` with
fields replaced, e.g. ``dataclasses.replace(target, quack=False)``) and hand it to
``moec.compile(..., target=...)`` or to an op's ``impl`` through :meth:`expert_impl` and
:meth:`implementation`; nothing here is a switch to flip.

Each op names its implementations in one table beside it (``IMPLEMENTATIONS`` in its module);
this module only knows which of them a target can run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from moec.kernels import flash_attention
from moec.kernels.arch import HAVE_TRITON, Arch, arch, interpreting
from moec.kernels.gemm_backend import KERNEL_BACKENDS, GemmPolicy, quack_importable

GemmChoice = Literal[
    "auto", "reference", "loop", "cute", "cute_glu", "grouped_mm", "tma", "pointer"
]
"""``Target.gemm``: the measured rules (``auto``), the ops' reference path (``reference``:
``torch._grouped_mm`` where it takes the operands, else a masked loop; ``loop``: always the
loop), or one kernel backend at every size."""

NATIVE_RECIPES: dict[str, str] = {"sm90": "fp8_rowwise", "sm100": "mxfp8"}
"""The low-precision recipe each arch runs on its own kernels (``fp8_rowwise``:
``torch._scaled_grouped_mm``, sm90 only: that op is never called elsewhere; ``mxfp8``: the
block-scaled MMA of sm100+). Any other recipe runs emulated (right values, not speed)."""


LOSS_CHUNK_ELEMENTS = 1 << 30
"""``Target.loss_chunk_elements`` by default: 2 GiB of bf16 logits, so few chunks that d_h's
GEMM fills the GPU and d_weight's accumulator is read by few epilogues
(``benchmarks/lm_head.py`` weighs the time against the memory)."""

BINARY_UNITS = ((40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki"))


def count_text(count: int) -> str:
    """An element count as ``moec debug`` prints it, exactly: in the largest binary unit that
    divides it (``2**30`` -> ``1 Gi``, ``3 << 20`` -> ``3 Mi``), else its digits grouped by
    thousands (``1000000`` -> ``1,000,000``; ``512`` -> ``512``)."""
    for shift, unit in BINARY_UNITS:
        if count and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count:,}"


EP_AUTO_PATHS: dict[str, str] = {"cuda": "rowwise"}
"""What ``parallel.ep_path: auto`` resolves to by device type: ``rowwise`` (symmetric memory)
on CUDA; elsewhere :data:`EP_FALLBACK_PATH`, the path every backend runs."""
EP_FALLBACK_PATH = "a2a_capacity"


@dataclasses.dataclass(frozen=True)
class Target:
    """The machine a program is bound for.

    ``device``: the device type the program runs on (``cuda``, ``cpu``; ``meta`` for a program
    only priced). ``arch``: :func:`moec.kernels.arch.arch` of that device (``interpreter`` off
    CUDA). ``triton``: moec's Triton kernels run (on CUDA, or on the CPU under
    ``TRITON_INTERPRET=1``). ``quack``: the CuTe DSL (quack-kernels) may run. ``fa4``:
    FlashAttention 4 (flash-attn-4) may run. ``gemm``: the grouped-GEMM choice
    (:data:`GemmChoice`). ``fused_loss``: the LM head's loss may run on quack's fused pipeline.
    ``loss_chunk_elements``: logits the fused loss (``moec::linear_cross_entropy``) computes
    at a time, at most (:func:`moec.ops.loss.chunk_rows`). ``ep_poison``: where not None, the
    EP exchanges fill every buffer row no route writes with it (tests: NaN, so that garbage a
    result read would show). ``ep_asynchronous``: whether split EP exchanges (pass
    ``overlap``) leave an a2a exchange running from its issue to its wait; None: on CUDA
    (gloo's exchanges run to completion at the issue, unless True). ``ep_copy_programs``: the
    programs per column tile of the ``rowwise`` split exchanges' copy kernel (None: one per
    route tile).

    On the CPU under the interpreter only the MXFP8 GEMMs bind to kernels (the others' kernels
    are tested there by naming their implementation: ``impl="triton"``).
    """

    device: str = "cpu"
    arch: Arch = "interpreter"
    triton: bool = False
    quack: bool = False
    fa4: bool = False
    gemm: GemmChoice = "auto"
    fused_loss: bool = True
    loss_chunk_elements: int = LOSS_CHUNK_ELEMENTS
    ep_poison: float | None = None
    ep_asynchronous: bool | None = None
    ep_copy_programs: int | None = None

    def __post_init__(self) -> None:
        if self.loss_chunk_elements < 1:
            raise ValueError(
                f"Target.loss_chunk_elements = {self.loss_chunk_elements}; accepted: >= 1"
            )
        if self.gemm not in ("auto", "reference", "loop", *KERNEL_BACKENDS):
            raise ValueError(
                f"Target.gemm = {self.gemm!r}; accepted: 'auto', 'reference', 'loop', "
                f"{', '.join(map(repr, KERNEL_BACKENDS))}"
            )

    @classmethod
    def detect(cls, device: torch.device | str | None = None) -> Target:
        """The target of ``device`` (default: CUDA where there is one, else the CPU) on this
        machine: its arch, and which of Triton, quack and FA4 import (FA4 only on sm90/sm100)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        family = arch(device) if device.type == "cuda" else "interpreter"
        on_kernels = device.type == "cuda" or (device.type == "cpu" and interpreting())
        gpu = family in ("sm90", "sm100")
        return cls(
            device=device.type,
            arch=family,
            triton=HAVE_TRITON and on_kernels,
            quack=gpu and quack_importable(),
            fa4=gpu and flash_attention.installed(),
        )

    def ep_path(self, requested: str) -> str:
        """``parallel.ep_path`` on this target: ``auto`` resolved (:data:`EP_AUTO_PATHS`), any
        other path as it is."""
        if requested != "auto":
            return requested
        return EP_AUTO_PATHS.get(self.device, EP_FALLBACK_PATH)

    @staticmethod
    def ep_paths(requested: str) -> tuple[str, ...]:
        """The paths ``requested`` resolves to on some target (what a check of the plan alone,
        before the target is known, must allow for)."""
        if requested != "auto":
            return (requested,)
        return tuple(dict.fromkeys((*EP_AUTO_PATHS.values(), EP_FALLBACK_PATH)))

    def op_arguments(self) -> dict[str, Any]:
        """The ``moec::`` op arguments the target supplies, by name (pass ``bind`` sets each on
        every op that takes it): the EP exchanges' ``poison``, the split ones' ``asynchronous``
        (``ep_asynchronous`` resolved) and ``copy_programs``, the fused loss's
        ``chunk_elements``."""
        asynchronous = self.ep_asynchronous
        return {
            "poison": self.ep_poison,
            "asynchronous": self.device == "cuda" if asynchronous is None else asynchronous,
            "copy_programs": self.ep_copy_programs,
            "chunk_elements": self.loss_chunk_elements,
        }

    @property
    def native_recipe(self) -> str | None:
        """The low-precision recipe with native kernels here (:data:`NATIVE_RECIPES`)."""
        return NATIVE_RECIPES.get(self.arch) if self.device == "cuda" else None

    def gemm_policy(self) -> GemmPolicy:
        """The kernels' grouped-GEMM policy (``gemm`` ``auto``: the measured rules)."""
        if self.gemm in ("auto", "reference", "loop"):
            return GemmPolicy(quack=self.quack)
        if self.gemm in ("cute", "cute_glu") and not self.quack:
            return GemmPolicy.parse("pointer")  # what the CuTe DSL passes to without quack
        return GemmPolicy.parse(self.gemm)

    def expert_impl(self, recipe: str) -> str:
        """The implementation ``moec::expert_mlp`` binds to for ``recipe`` (see
        :data:`moec.ops.experts.IMPLEMENTATIONS`): ``reference``/``loop`` (pure PyTorch; a
        low-precision recipe fake-quantized), ``kernels:<policy>`` (moec's kernels, bf16 on the
        :meth:`gemm_policy`), ``kernels`` (a low-precision recipe emulated on the kernels: mxfp8
        on the Triton MXFP8 kernels, whose MMA is emulated off sm100, also under the
        interpreter; another recipe fake-quantized into the grouped-GEMM kernels) or ``native``
        (the recipe on this arch's own kernels)."""
        if self.gemm in ("reference", "loop") or not self.triton:
            return "loop" if self.gemm == "loop" else "reference"
        on_cuda = self.device == "cuda"
        if recipe == "bf16":
            return f"kernels:{self.gemm_policy().spec()}" if on_cuda else "reference"
        if recipe == self.native_recipe:
            return "native"
        return "kernels" if on_cuda or recipe == "mxfp8" else "reference"

    def implementation(self, op: str) -> str:
        """The implementation the other ``moec::`` ops bind to: ``fa4`` for attention where FA4
        may run; ``triton`` where moec's kernels run, ``cute`` for the LM head's loss where
        quack's pipeline may run (it takes the head's shapes at run time, else the Triton loss
        runs); else ``reference``."""
        if op == "flash_attention":
            return "fa4" if self.fa4 else "reference"
        if not (self.triton and self.device == "cuda"):
            return "reference"
        if op == "linear_cross_entropy" and self.quack and self.fused_loss:
            return "cute"
        return "triton"

    def describe(self) -> str:
        """One line: what the target is (``moec debug`` prints it)."""
        fields = [f"{self.device} {self.arch}"]
        fields += [name for name in ("triton", "quack", "fa4") if getattr(self, name)]
        if self.gemm != "auto":
            fields.append(f"gemm={self.gemm}")
        if not self.fused_loss:
            fields.append("fused_loss=off")
        if self.loss_chunk_elements != LOSS_CHUNK_ELEMENTS:
            fields.append(f"loss chunks of {count_text(self.loss_chunk_elements)} logits")
        if self.ep_poison is not None:
            fields.append(f"EP buffers poisoned with {self.ep_poison}")
        if self.ep_asynchronous is not None:
            fields.append(f"ep_asynchronous={self.ep_asynchronous}")
        if self.ep_copy_programs is not None:
            fields.append(f"ep_copy_programs={self.ep_copy_programs}")
        native = self.native_recipe
        fields.append(f"native low precision: {native or 'none'}")
        return ", ".join(fields)
