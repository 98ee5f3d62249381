"""What is trained: the next-token loss of a language model (captured with the model so the
``fused_loss`` pass can fuse it with the LM head), its optional LM-head z-loss, and the
optimizer's parameter groups.

LM-head z-loss (PaLM's auxiliary loss, the report's B.7): ``z_loss * mean(logsumexp(logits)^2)``
over every position, added to the cross-entropy on the device. It needs each row's logsumexp,
which ``moec::linear_cross_entropy`` computes but does not return: with z-loss on, the logits
are read twice and the ``fused_loss`` pass leaves the head unfused (it reports the head in its
``skipped`` stats, and the trainer says so once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from moec.runtime.compiled import CompiledModel
from moec.runtime.distributed import parameter_groups as dist_parameter_groups


def language_model_loss(output: Any, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy (float32 softmax), plus the LM-head z-loss with coefficient
    ``z_loss`` (see module)."""
    logits = output.logits if hasattr(output, "logits") else output
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    logits = logits.float().flatten(0, 1)
    loss = F.cross_entropy(logits, targets.flatten())
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).square().mean()
    return loss


class LanguageModelWithLoss(torch.nn.Module):
    """``model(inputs)`` and its next-token loss as one module: the loss is then part of the
    captured graph, where the ``fused_loss`` pass can fuse it with the LM head. A Hugging Face
    model is called with ``use_cache=False``: a training step has no use for its KV cache, and
    the cache's tensors would become constants of the graph (on the meta device, for a model
    built there)."""

    def __init__(self, model: torch.nn.Module, z_loss: float = 0.0):
        super().__init__()
        self.model = model
        self.z_loss = z_loss

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        config = getattr(self.model, "config", None)
        kwargs = {"use_cache": False} if getattr(config, "use_cache", False) else {}
        return language_model_loss(self.model(inputs, **kwargs), targets, self.z_loss)


DEFAULT_NO_DECAY = ("embeddings", "norms", "biases")


def parameter_groups(
    compiled: CompiledModel, weight_decay: float, no_decay: Iterable[str] = DEFAULT_NO_DECAY
) -> list[dict[str, Any]]:
    """The optimizer's groups: the dense and expert parameters
    (:func:`moec.runtime.distributed.parameter_groups`), each split into decayed and undecayed
    parameters. ``no_decay`` names the undecayed kinds (``TrainConfig.no_decay``): embeddings
    (tables read by ``aten.embedding``), biases (of linears), norms (the other 1-D parameters),
    lm_head (the weight of the linear whose logits the loss reads, fused or not); found from
    the graph, not from names."""
    no_decay = set(no_decay)
    gm = compiled.graph_module
    found = parameter_kinds(gm)
    excluded = set().union(*(found[kind] for kind in no_decay if kind in found))
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for kind, params in zip(("dense", "expert"), dist_parameter_groups(compiled), strict=True):
        for param in params:
            vector = param.dim() < 2
            is_norm = vector and id(param) not in found["biases"]
            decay = id(param) not in excluded and not (is_norm and "norms" in no_decay)
            groups.setdefault((kind, decay), []).append(param)
    return [
        {
            "name": f"{kind}{'' if decay else '_no_decay'}",
            "params": params,
            "weight_decay": weight_decay if decay else 0.0,
        }
        for (kind, decay), params in sorted(groups.items())
    ]


def parameter_kinds(gm: fx.GraphModule) -> dict[str, set[int]]:
    """ids of the parameters the graph uses as embeddings, linear biases and the LM head."""
    aten = torch.ops.aten
    kinds: dict[str, set[int]] = {"embeddings": set(), "biases": set(), "lm_head": set()}

    def add(kind: str, node: Any) -> None:
        param = _parameter_behind(gm, node)
        if param is not None:
            kinds[kind].add(id(param))

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target == aten.embedding.default:
            add("embeddings", n.args[0])
        elif n.target == aten.linear.default and len(n.args) > 2:
            add("biases", n.args[2])
        elif n.target == aten.addmm.default:
            add("biases", n.args[0])
        elif n.target == torch.ops.moec.linear_cross_entropy.default:
            add("lm_head", n.args[1])
            if len(n.args) > 2:
                add("biases", n.args[2])
        elif n.target == aten.cross_entropy_loss.default:
            head = n.args[0]  # through views and casts to the linear that makes the logits
            while isinstance(head, fx.Node) and head.op == "call_function":
                if head.target == aten.linear.default:
                    add("lm_head", head.args[1])
                    break
                head = head.args[0] if head.args else None
    return kinds


def _parameter_behind(gm: fx.GraphModule, node: Any) -> torch.nn.Parameter | None:
    """The parameter a node reads, through casts and working copies (their first input)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    try:
        return gm.get_parameter(str(node.target))
    except AttributeError:
        return None
