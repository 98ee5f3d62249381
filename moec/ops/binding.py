"""How a ``moec::`` op finds the implementation it runs: its ``impl`` argument.

Every op with more than one implementation names them in one table beside it
(``IMPLEMENTATIONS`` in its module) and takes a last argument ``impl``: one of those names,
bound by pass ``bind`` (:mod:`moec.passes.bind`) for the program's
:class:`~moec.kernels.target.Target`, or ``"auto"`` for a direct call (a test, a benchmark, a
user's code), which binds against the target detected for the operands' device. An
implementation that does not take some operands (a dtype or device its kernel lacks) runs the
reference for them, so every name gives the reference's values.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from moec.kernels.target import Target


@functools.cache
def detected(device: torch.device) -> Target:
    """The target of ``device`` on this machine (:meth:`Target.detect`), once per device."""
    return Target.detect(device)


def resolve(op: str, impl: str, tensor: torch.Tensor, names: Iterable[str]) -> str:
    """``impl`` of ``moec::<op>`` checked against its table's ``names``; ``"auto"``: what the
    detected target of ``tensor``'s device binds (:meth:`Target.implementation`)."""
    names = tuple(names)
    if impl == "auto":
        impl = detected(tensor.device).implementation(op)
        if impl not in names:  # e.g. the fused loss's "cute" on an op without it
            impl = "triton" if impl != "reference" and "triton" in names else "reference"
    if impl not in names:
        raise ValueError(f"moec::{op}: impl {impl!r}; known: 'auto', {', '.join(names)}")
    return impl
