"""What a captured graph's size symbols mean: tokens per step and the ``batch``/``seq`` names.

Sizes of ``meta["val"]`` shapes are sympy expressions in the ShapeEnv's symbols (``s0``,
``s1``); these functions read which expression is the step's token count and which symbols are
the batch and sequence dimensions, so a cost can be evaluated as ``batch=8, seq=4096``.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from moec.fx import numel, sym


def _tensor_inputs(gm: fx.GraphModule) -> list[torch.Tensor]:
    vals = (n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
    return [v for v in vals if isinstance(v, torch.Tensor)]


def tokens(gm: fx.GraphModule) -> sympy.Expr:
    """Tokens per step: numel of the first integer input (token ids), else all but the last
    dimension of the first input (1 without tensor inputs)."""
    inputs = _tensor_inputs(gm)
    if not inputs:
        return sympy.Integer(1)
    integer = [v for v in inputs if not v.is_floating_point() and not v.is_complex()]
    if integer:
        return numel(integer[0])
    return numel(inputs[0]) / sym(inputs[0].shape[-1]) if inputs[0].dim() else sympy.Integer(1)


def friendly_dims(gm: fx.GraphModule) -> dict[str, sympy.Symbol]:
    """``batch``/``seq``: the size symbols of dims 0/1 of the first input with symbolic sizes
    (integer inputs first: token ids)."""
    inputs = sorted(_tensor_inputs(gm), key=lambda v: v.is_floating_point())
    for value in inputs:
        names = {}
        for name, size in zip(("batch", "seq"), value.shape, strict=False):
            free = getattr(sym(size), "free_symbols", set())
            if len(free) == 1:
                names[name] = next(iter(free))
        if names:
            return names
    return {}
