"""The ``moec::`` custom ops: MoE semantics as opaque, autograd-aware graph nodes.

Importing this package registers ``torch.ops.moec.{route, router_losses, dispatch, combine,
expert_mlp, flash_attention, glu, linear_cross_entropy, rope, quantized_linear}``. Each op's
module holds its pure-PyTorch reference, the oracle for every faster implementation, and one
table, ``IMPLEMENTATIONS``, naming the implementations its ``impl`` argument selects (the
reference and the kernels of :mod:`moec.kernels`; :mod:`moec.ops.binding`).
"""

import moec.ops.ep  # noqa: F401  (registers the moec::ep_* ops)
from moec.ops.attention import flash_attention
from moec.ops.experts import expert_mlp
from moec.ops.glu import glu
from moec.ops.loss import linear_cross_entropy
from moec.ops.movement import combine, dispatch
from moec.ops.quantized import quantized_linear
from moec.ops.rope import rope
from moec.ops.routing import capacity, route, router_losses

__all__ = [
    "capacity",
    "combine",
    "dispatch",
    "expert_mlp",
    "flash_attention",
    "glu",
    "linear_cross_entropy",
    "quantized_linear",
    "rope",
    "route",
    "router_losses",
]
