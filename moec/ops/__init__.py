"""The ``moec::`` custom ops: MoE semantics as opaque, autograd-aware graph nodes.

Importing this package registers ``torch.ops.moec.{route, router_losses, dispatch, combine,
expert_mlp, expert_mlp_gathered, expert_mlp_combined, flash_attention, glu,
linear_cross_entropy, rope, quantized_expert_mlp, quantized_linear}`` and the expert-parallel
ops of :mod:`moec.ops.ep`. Each op's Python body is the
pure-PyTorch reference, the oracle for every faster implementation;
:func:`moec.ops.cuda.register_kernels` registers CUDA implementations on the Triton kernels of
:mod:`moec.kernels` over the same schemas; importing this package does that where CUDA is
available.
"""

import torch

import moec.ops.ep  # noqa: F401  (registers the moec::ep_* ops)
from moec.ops.attention import flash_attention
from moec.ops.combined_experts import expert_mlp_combined
from moec.ops.experts import expert_mlp
from moec.ops.gathered_experts import expert_mlp_gathered
from moec.ops.glu import glu
from moec.ops.loss import linear_cross_entropy
from moec.ops.movement import combine, dispatch
from moec.ops.quantized import quantized_expert_mlp, quantized_linear
from moec.ops.rope import rope
from moec.ops.routing import capacity, route, router_losses

__all__ = [
    "capacity",
    "combine",
    "dispatch",
    "expert_mlp",
    "expert_mlp_combined",
    "expert_mlp_gathered",
    "flash_attention",
    "glu",
    "linear_cross_entropy",
    "quantized_expert_mlp",
    "quantized_linear",
    "rope",
    "route",
    "router_losses",
]

if torch.cuda.is_available():  # the ops pick the Triton kernels on CUDA automatically
    from moec.ops.cuda import register_kernels as _register_kernels

    _register_kernels()
