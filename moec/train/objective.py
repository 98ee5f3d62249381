"""What is trained: the next-token loss of a language model (captured with the model so the
``fused_loss`` pass can fuse it with the LM head) and the optimizer's parameter groups."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moec.runtime.compiled import CompiledModel
from moec.runtime.distributed import parameter_groups as dist_parameter_groups


def language_model_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class LanguageModelWithLoss(torch.nn.Module):
    """``model(inputs)`` and its next-token loss as one module: the loss is then part of the
    captured graph, where the ``fused_loss`` pass can fuse it with the LM head. A Hugging Face
    model is called with ``use_cache=False``: a training step has no use for its KV cache, and
    the cache's tensors would become constants of the graph (on the meta device, for a model
    built there)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        config = getattr(self.model, "config", None)
        kwargs = {"use_cache": False} if getattr(config, "use_cache", False) else {}
        return language_model_loss(self.model(inputs, **kwargs), targets)


def parameter_groups(compiled: CompiledModel, weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's groups: the dense and expert parameters
    (:func:`moec.runtime.distributed.parameter_groups`), each split into decayed matrices and
    undecayed embeddings/norms/biases."""
    gm = compiled.graph_module
    embeddings = {
        id(gm.get_parameter(str(n.args[0].target)))
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.embedding.default
    }
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for kind, params in zip(("dense", "expert"), dist_parameter_groups(compiled), strict=True):
        for param in params:
            decay = param.dim() >= 2 and id(param) not in embeddings
            groups.setdefault((kind, decay), []).append(param)
    return [
        {
            "name": f"{kind}{'' if decay else '_no_decay'}",
            "params": params,
            "weight_decay": weight_decay if decay else 0.0,
        }
        for (kind, decay), params in sorted(groups.items())
    ]
