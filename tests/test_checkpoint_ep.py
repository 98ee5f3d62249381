"""Checkpoints across EP degrees: EP = 2 (2 gloo ranks) -> EP = 1 (this process) and back.

A loaded model equals the writer's parameters, buffers (the ``aux_free`` selection biases,
replicated) and AdamW state in the global layout (the EP ranks' expert slices concatenated on
dim 0) and gives the writer's outputs on the same input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

import moec
from moec.models import Llama, LlamaConfig
from moec.runtime import checkpoint
from moec.runtime import distributed as mdist
from tests.distributed import spawn

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
MOE = {
    "num_experts": 4,
    "top_k": 2,
    "capacity_factor": None,
    "dense_first": 0,
    "init": "random",
    "balance": "aux_free",  # the routers' selection bias moves between the layouts too
    "bias_update_rate": 0.01,
}
WORLD = 2


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    return seq[:, :-1], seq[:, 1:]


def _compile(mesh: mdist.MoEMesh | None) -> moec.CompiledModel:
    torch.manual_seed(0)
    ep = 1 if mesh is None else WORLD
    plan = moec.Plan.from_dict({"moe": MOE, "parallel": {"dp": ep, "ep": ep}})
    return moec.compile(Llama(CFG), plan, (_batch(0)[0],), mesh=mesh)


def _step(model: moec.CompiledModel, mesh: mdist.MoEMesh | None, rank: int) -> Any:
    """One AdamW step on ``rank``'s batch (gradients averaged over the ranks under EP)."""
    if mesh is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = mdist.build_optimizer(model, mesh, torch.optim.AdamW, lr=1e-2)
        reducer = mdist.GradientReducer(model, mesh)
    tokens, targets = _batch(rank)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    (loss + model.aux_loss()).backward()
    if mesh is not None:
        reducer.finish()
    model.finish_step()  # moves the aux_free biases (replicated: the global load's update)
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def _snapshot(model: moec.CompiledModel, optimizer: Any) -> dict[str, Any]:
    """Parameters, AdamW state and each rank's-batch outputs, as plain tensors."""
    optimizers = list(getattr(optimizer, "optimizers", [optimizer]))
    params, optim = get_state_dict(model, optimizers)
    with torch.no_grad():
        logits = [model(_batch(rank)[0]) for rank in range(WORLD)]
    return {
        "model": {k: v.detach().clone() for k, v in params.items()},
        "optim": {k: {s: t.clone() for s, t in v.items()} for k, v in optim["state"].items()},
        "logits": logits,
    }


def _expert(model: moec.CompiledModel, name: str) -> bool:
    return model.program.role(name) == "expert"


def _assert_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["model"].keys() == want["model"].keys()
    for name, value in want["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=0, atol=0, msg=name)
    assert got["optim"].keys() == want["optim"].keys()
    for name, state in want["optim"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["optim"][name][key], value, rtol=0, atol=0)


def _ep_slice(full: dict[str, Any], model: moec.CompiledModel, rank: int) -> dict[str, Any]:
    """The EP = 1 snapshot ``full`` restricted to ``rank``'s experts."""

    def part(name: str, t: torch.Tensor) -> torch.Tensor:
        if not _expert(model, name) or t.dim() == 0:
            return t
        local = t.shape[0] // WORLD
        return t[rank * local : (rank + 1) * local]

    return {
        "model": {k: part(k, v) for k, v in full["model"].items()},
        "optim": {k: {s: part(k, t) for s, t in v.items()} for k, v in full["optim"].items()},
    }


def _ep2_worker(rank: int, world: int, root: Path) -> None:
    mesh = mdist.build_mesh(moec.Plan.from_dict({"moe": MOE, "parallel": {"dp": world, "ep": 2}}))
    # EP = 1 -> EP = 2
    model = _compile(mesh)
    optimizer = mdist.build_optimizer(model, mesh, torch.optim.AdamW, lr=1e-2)
    checkpoint.load(model, optimizer, root / "ep1", mesh)
    got, full = _snapshot(model, optimizer), torch.load(root / "ep1.pt")
    _assert_state(got, _ep_slice(full, model, rank))
    torch.testing.assert_close(got["logits"][rank], full["logits"][rank], rtol=0, atol=1e-5)
    # EP = 2 -> (EP = 1, in the test process)
    model = _compile(mesh)
    optimizer = _step(model, mesh, rank)
    checkpoint.save(model, optimizer, root / "ep2", mesh)
    torch.save(_snapshot(model, optimizer), root / f"ep2_rank{rank}.pt")


@pytest.mark.slow
def test_checkpoint_moves_between_ep1_and_ep2(tmp_path):
    writer = _compile(None)
    optimizer = _step(writer, None, 0)
    checkpoint.save(writer, optimizer, tmp_path / "ep1")
    torch.save(_snapshot(writer, optimizer), tmp_path / "ep1.pt")

    spawn(_ep2_worker, WORLD, tmp_path)

    model = _compile(None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(model, optimizer, tmp_path / "ep2")
    got = _snapshot(model, optimizer)
    ranks = [torch.load(tmp_path / f"ep2_rank{r}.pt") for r in range(WORLD)]

    def joined(name: str, values: list[torch.Tensor]) -> torch.Tensor:
        expert = _expert(model, name) and values[0].dim() > 0
        return torch.cat(values) if expert else values[0]

    want = {
        "model": {k: joined(k, [r["model"][k] for r in ranks]) for k in ranks[0]["model"]},
        "optim": {
            k: {s: joined(k, [r["optim"][k][s] for r in ranks]) for s in v}
            for k, v in ranks[0]["optim"].items()
        },
    }
    biases = [v for k, v in want["model"].items() if k.endswith("expert_bias")]
    assert len(biases) == CFG.n_layers and all(b.abs().sum() > 0 for b in biases)
    _assert_state(got, want)
    for rank in range(WORLD):
        torch.testing.assert_close(
            got["logits"][rank], ranks[rank]["logits"][rank], rtol=0, atol=1e-5
        )
