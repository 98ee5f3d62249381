"""Pass ``fused_loss``: an LM head followed by cross-entropy -> ``moec::linear_cross_entropy``.

Matches  ``cross_entropy_loss(logits, targets, weight=None, reduction, ignore_index,
         label_smoothing=0.0)`` with reduction mean or sum, 1-D integer targets, and ``logits``
         [N, V] reached from ``linear(h, W, b?)`` through flatten / view / reshape and casts to
         float32 only, every link read by nothing else (export's ``_assert_tensor_metadata``
         checks aside).
Emits    ``h2 = reshape(h, [-1, D])``; ``out = moec.linear_cross_entropy(h2, W, b, targets,
         ignore_index, reduction)``; ``out[0]`` replaces the loss; the head, the chain and its
         checks are erased.
Keeps    the loss (float32 softmax statistics, as the upcast original) and its gradients with
         respect to h, W and b; the graph outputs and parameters. A head whose logits are read
         elsewhere (returned, sliced, logged) is left alone and reported in ``stats["skipped"]``:
         fusing it would not remove the logits.

Pipelined programs (``parallel.pp > 1``) are fused the same way, before the ``pipeline`` pass
splits them: the fused op lands in the last stage, which then returns the loss (the mean over
the microbatch's tokens, as at PP = 1) instead of logits, and reads the targets as a graph input
(:mod:`moec.runtime.pipeline`). A model that returns logits has no loss in its graph; its
pipeline runtime applies an unfused cross-entropy to the last stage's logits.

Under ``torch.no_grad()`` the runtime runs a variant whose ops skip the head's gradients, which
a training forward computes ahead of the backward (:func:`moec.runtime.variants.forward_only`).

Why: at a large vocabulary the fp32 logits, their log-softmax and its gradient are the largest
tensors of a step and three full passes over memory; the fused op streams row chunks and never
holds more than one chunk of logits.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.analysis.structure import VIEW_OPS
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.casts import CASTS
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan

aten = torch.ops.aten
REDUCTIONS = {1: "mean", 2: "sum"}  # ATen's Reduction enum; 0 ("none") is not fused


def _users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target != aten._assert_tensor_metadata.default]


def _is_float32_cast(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return node.target in CASTS and isinstance(val, torch.Tensor) and val.dtype == torch.float32


def _head_chain(loss: fx.Node) -> tuple[fx.Node, list[fx.Node]] | str:
    """(the linear, the nodes between it and the loss) or why the loss does not match."""
    chain: list[fx.Node] = []
    node = loss.args[0]
    while isinstance(node, fx.Node) and (node.target in VIEW_OPS or _is_float32_cast(node)):
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target == aten.linear.default):
        return "logits do not come from a linear through views and float32 casts"
    if loss.args[0].meta["val"].shape[-1] != node.meta["val"].shape[-1]:
        return "the views between the head and the loss change the class dimension"
    for link in [node, *chain]:
        if len(_users(link)) != 1:
            return f"logits {link.name!r} are also read elsewhere"
    return node, chain


def _loss_args(loss: fx.Node) -> tuple[int, str] | str:
    """(ignore_index, reduction) or why the loss does not match."""
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = (None, None, None, 1, -100, 0.0)
    args = dict(zip(names, defaults))
    args.update(zip(names, loss.args))
    args.update(loss.kwargs)
    logits, targets = loss.args[0].meta["val"], loss.args[1].meta["val"]
    if args["weight"] is not None or args["label_smoothing"] != 0.0:
        return "class weights or label smoothing"
    if args["reduction"] not in REDUCTIONS:
        return "reduction 'none'"
    if logits.dim() != 2 or targets.dim() != 1 or targets.dtype.is_floating_point:
        return "logits are not [N, V] with integer targets [N]"
    return args["ignore_index"], REDUCTIONS[args["reduction"]]


@register_pass
class FusedLossPass(Pass):
    name = "fused_loss"
    after: tuple[str, ...] = ("moe", "expert_parallel", "precision")

    @staticmethod
    def applies(plan: Plan) -> bool:
        """loss.fused (pipelined programs too: the fused loss lands in the last stage)"""
        return plan.loss.fused

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        edit = GraphEditor(gm, self.name)
        fused, skipped = 0, []
        losses = [n for n in gm.graph.nodes if n.target == aten.cross_entropy_loss.default]
        for loss in losses:
            head = _head_chain(loss)
            options = _loss_args(loss)
            if isinstance(head, str) or isinstance(options, str):
                skipped.append(f"{loss.name}: {head if isinstance(head, str) else options}")
                continue
            linear, chain = head
            h, weight, *bias = linear.args
            with gm.graph.inserting_before(loss):
                width = h.meta["val"].shape[-1]
                if isinstance(width, torch.SymInt):  # a size the graph reads, not a number
                    width = edit.call(aten.sym_size.int, (h, h.meta["val"].dim() - 1), linear)
                rows = edit.call(aten.reshape.default, (h, [-1, width]), linear)
                out = edit.call(
                    torch.ops.moec.linear_cross_entropy.default,
                    (rows, weight, bias[0] if bias else None, loss.args[1], *options),
                    linear,
                )
                value = edit.getitem(out, 0)
            loss.replace_all_uses_with(value)
            for node in [loss, *chain, linear]:
                for check in list(node.users):
                    gm.graph.erase_node(check)  # the _assert_tensor_metadata checks
                gm.graph.erase_node(node)
            fused += 1
        gm.recompile()
        return PassResult(gm, fused > 0, {"fused": fused, "skipped": skipped})
