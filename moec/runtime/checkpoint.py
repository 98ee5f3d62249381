"""Checkpoints that load at any expert- or pipeline-parallel degree (DCP).

Written with ``torch.distributed.checkpoint``. What is saved: the compiled model's parameters and
its optimizer's state, as returned by
``get_state_dict(compiled, optimizers, flatten_optimizer_state_dict=True)``, under ``{"model":
..., "optim": ...}``. Every key names a parameter by its fully qualified name in the full graph
(e.g. ``layers.0.ffn.moe.w_up``; optimizer entries ``state.<name>.exp_avg``,
``param_groups.<name>.lr``), which depends on neither the EP nor the pipeline degree.

Layout: every tensor is stored in its *global* (EP = 1) shape. Under EP = n each rank holds the
experts ``[rank*N/n, (rank+1)*N/n)`` of every ``expert`` parameter (dim 0, see
:mod:`moec.passes.expert_parallel`; the program's ``param_roles``); those slices, and the
optimizer state tensors of the same shape, are wrapped as ``DTensor`` on the (edp, ep) mesh with
placements ``[Replicate(), Shard(0)]``, so DCP writes each expert once with its global offset.
Loading wraps the reader's tensors in the reader's layout and DCP reads the overlapping chunks:
a checkpoint written at EP = a loads at EP = b for any a, b dividing N (EP = 1: ``mesh=None``,
plain DCP, also without a process group). Under pipeline parallelism a rank holds only its
stages' parameters (and their optimizer state): it writes and reads those keys alone, so a
checkpoint written at PP = a loads at PP = b (``mesh`` is then the pipeline mesh's ``moe`` part;
the optimizer is the pipeline runtime's).

Invariants: the reader compiles the same model and plan apart from ``parallel`` (same parameter
names and global shapes) and builds the same optimizer class; after ``load`` every parameter and
state tensor equals the writer's global tensor restricted to the reader's experts. Scalars
(``step``) are replicated. Dense parameters FSDP shards (``parallel.dp_shard > 1``,
:mod:`moec.runtime.fsdp`) are ``DTensor`` s already, on the data-parallel mesh, so a checkpoint
moves between DDP, FSDP and HSDP layouts as it does between EP degrees. Not supported: ZeRO-1
sharded optimizers (``build_optimizer(zero=True)``), whose state is not in
``get_state_dict``'s per-name form.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from moec.runtime import safe_read
from moec.runtime.distributed import MoEMesh

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""One key per parameter and state entry: ranks holding different parameters (pipeline stages)
write disjoint keys, where nested ``param_groups`` lists would collide."""


def save(
    compiled: nn.Module, optimizer: Any, path: str | os.PathLike, mesh: MoEMesh | None = None
) -> None:
    """Write ``compiled``'s parameters and ``optimizer``'s state to the directory ``path``
    (collective over the job when ``mesh`` is given)."""
    with _quiet():
        dcp.save(_state(compiled, optimizer, mesh)[0], checkpoint_id=str(path))


def load(
    compiled: nn.Module, optimizer: Any, path: str | os.PathLike, mesh: MoEMesh | None = None
) -> None:
    """Read the checkpoint at ``path`` into ``compiled`` and ``optimizer``, resharding the
    experts to this rank's EP layout (collective over the job when ``mesh`` is given). Read
    by :func:`moec.runtime.safe_read.dcp_load`: nothing in the folder can run code."""
    state, held = _state(compiled, optimizer, mesh)
    safe_read.dcp_load(state, path)
    set_state_dict(
        compiled,
        _optimizers(optimizer),
        model_state_dict={k: _held(v, held["model"][k]) for k, v in state["model"].items()},
        optim_state_dict={k: _held(v, held["optim"][k]) for k, v in state["optim"].items()},
        options=FLAT,
    )


State = dict[str, dict[str, Any]]


def _state(compiled: nn.Module, optimizer: Any, mesh: MoEMesh | None) -> tuple[State, State]:
    """The state dict in the global layout (expert tensors as DTensors when EP > 1), and the
    state dict as this rank holds it."""
    for opt in _optimizers(optimizer):
        if hasattr(opt, "ensure_state"):  # moec.optim.AdamW: state made its own way
            opt.ensure_state()
    model, optim = get_state_dict(compiled, _optimizers(optimizer), options=FLAT)
    held = {"model": model, "optim": optim}
    if mesh is None or mesh.ep_info.size == 1:
        return held, held
    experts = {n for n in model if compiled.program.role(n) == "expert"}

    def wrap(value: Any, name: str) -> Any:
        if name in experts and isinstance(value, torch.Tensor) and value.dim() > 0:
            return _global(value, mesh)
        return value

    def param_of(key: str) -> str:  # "state.<param>.<entry>" -> "<param>"
        return key.removeprefix("state.").rpartition(".")[0] if key.startswith("state.") else ""

    wrapped = {
        "model": {k: wrap(v, k) for k, v in model.items()},
        "optim": {k: wrap(v, param_of(k)) for k, v in optim.items()},
    }
    return wrapped, held


def _global(local: torch.Tensor, mesh: MoEMesh) -> DTensor:
    """This rank's expert slice as a view of the global tensor: sharded over EP on dim 0, and
    over the ranks holding the same experts (edp) replicated, or, when FSDP shards the slice
    there (an FSDP ``DTensor``, split on dim 1), sharded on dim 1."""
    if not isinstance(local, DTensor):
        return DTensor.from_local(local, mesh.device_mesh, [Replicate(), Shard(0)], run_check=False)
    shape = (local.shape[0] * mesh.ep_info.size, *local.shape[1:])
    return DTensor.from_local(
        local.to_local(),
        mesh.device_mesh,
        [Shard(1), Shard(0)],
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def _held(value: Any, held: Any) -> Any:
    """A loaded tensor in the layout this rank holds it in (``held``, from :func:`_state`)."""
    if value is held or not isinstance(value, DTensor):
        return value
    if isinstance(held, DTensor):  # an FSDP shard: the same local part, FSDP's layout
        return DTensor.from_local(
            value.to_local(),
            held.device_mesh,
            held.placements,
            shape=held.shape,
            stride=held.stride(),
            run_check=False,
        )
    return value.to_local()


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """A torch optimizer, or :class:`moec.runtime.distributed.Optimizers`, as a list."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
