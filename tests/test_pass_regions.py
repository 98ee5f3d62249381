"""Pass ``regions``: a graph break after every residual block but the last; under Inductor (its
CPU backend) the program compiles to one graph and one backward node per block and computes
what the whole program computes, in float32 and bf16, and a DP = 2 job trains the same;
pipelines refuse it; the reducer's buckets are large only for a program compiled whole."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import moec
from moec.models import Llama, LlamaConfig
from moec.passes.regions import BREAK
from tests.distributed import spawn

CFG = LlamaConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128)
MOE = {"num_experts": 4, "top_k": 2, "capacity_factor": 4.0, "init": "random"}


def _compiled(regions: str, dtype: torch.dtype = torch.float32, inductor: bool = False):
    torch.manual_seed(0)
    dense = Llama(CFG).to(dtype)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    plan = {"moe": MOE, "lowering": {"regions": regions, "inductor": inductor}}
    model = moec.compile(copy.deepcopy(dense), moec.Plan.from_dict(plan), (tokens,))
    return model, tokens


def _backward_nodes(out: torch.Tensor) -> int:
    """AOTAutograd backward nodes in ``out``'s autograd graph."""
    seen, todo, found = set(), [out.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += "CompiledFunction" in type(node).__name__
        todo += [nxt for nxt, _ in node.next_functions]
    return found


def test_a_break_after_every_block_but_the_last():
    model, tokens = _compiled("blocks")
    stats = model.pass_results["regions"].stats
    breaks = [n for n in model.graph_module.graph.nodes if n.target is BREAK]
    assert stats["regions"] == CFG.n_layers and len(breaks) == CFG.n_layers - 1
    assert [n.prev.name for n in breaks] == stats["boundaries"]
    whole, _ = _compiled("whole")
    assert "regions" not in whole.pass_results
    torch.testing.assert_close(model(tokens), whole(tokens), rtol=0, atol=0)  # eagerly: no-ops


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_compiles_a_graph_per_block_computing_what_the_whole_does(dtype):
    results = {}
    for regions in ("whole", "blocks"):
        torch._dynamo.reset()
        counters.clear()
        model, tokens = _compiled(regions, dtype, inductor=True)
        out = model(tokens)
        nodes = _backward_nodes(out)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        out.backward(grad_out)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[regions] = (out.detach(), grads, counters["stats"]["unique_graphs"], nodes)
    (out_w, grads_w, graphs_w, nodes_w), (out_b, grads_b, graphs_b, nodes_b) = results.values()
    assert (graphs_w, nodes_w) == (1, 1)
    assert (graphs_b, nodes_b) == (CFG.n_layers, CFG.n_layers)  # one backward node per block
    bf16 = dtype == torch.bfloat16
    tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out_b, out_w, **tol)
    assert grads_b.keys() == grads_w.keys() and grads_w
    for name in grads_w:
        if dtype == torch.float32:
            torch.testing.assert_close(grads_b[name], grads_w[name], **tol, msg=name)
        else:  # fused differently at the breaks: bf16 roundings differ, not the gradient
            got, want = grads_b[name].float(), grads_w[name].float()
            assert (got - want).norm() <= 2e-2 * want.norm(), name


def test_pipelines_refuse_blocks():
    plan = {"lowering": {"regions": "blocks"}, "parallel": {"pp": 2, "microbatches": 2}}
    with pytest.raises(moec.PlanError, match="lowering.regions.*parallel.pp = 2"):
        moec.Plan.from_dict(plan)


def _regions_worker(rank: int, world: int, out: str) -> None:
    """Two DP = 2 trainers (EP = 1, Inductor on the CPU), compiled whole and block by block:
    the same losses and parameters (the reducer's hooks fire per block with ``blocks``)."""
    from moec.train import TrainConfig, Trainer
    from tests.models import tiny_llama

    finals = {}
    for regions in ("whole", "blocks"):
        torch.manual_seed(0)  # the same init on every rank and for both
        torch._dynamo.reset()
        cfg = TrainConfig(
            steps=2, batch_size=4, seq_len=16, lr=1e-3, warmup_steps=1, log_every=1,
            out=f"{out}/{regions}", plots=False, device="cpu",
        )  # fmt: skip
        lowering = {"regions": regions, "inductor": True}
        plan = {"moe": MOE, "parallel": {"dp": 2}, "lowering": lowering}
        trainer = Trainer(tiny_llama(2), moec.Plan.from_dict(plan), cfg)
        losses = trainer.run().losses
        params = {n: p.detach().clone() for n, p in trainer.compiled.named_parameters()}
        finals[regions] = (losses, params)
    (losses_w, params_w), (losses_b, params_b) = finals.values()
    torch.testing.assert_close(torch.tensor(losses_b), torch.tensor(losses_w), rtol=1e-5, atol=0)
    for name, value in params_w.items():
        torch.testing.assert_close(params_b[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_data_parallel_training_is_the_same_block_by_block(tmp_path):
    spawn(_regions_worker, 2, str(tmp_path))


def test_gradient_buckets_are_large_only_where_every_gradient_comes_at_once():
    """One compiled backward hands every gradient over at its end: large buckets (NCCL's rate
    grows with the message); eagerly or block by block they arrive during the backward."""
    from moec.runtime.distributed import BUCKET_BYTES, LATE_BUCKET_BYTES, bucket_bytes_for

    def plan(regions: str, **extra) -> moec.Plan:
        return moec.Plan.from_dict({"parallel": {"dp": 2}, "lowering": {"regions": regions},
                                    **extra})  # fmt: skip

    assert bucket_bytes_for(plan("whole"), "cuda") == LATE_BUCKET_BYTES
    assert bucket_bytes_for(plan("blocks"), "cuda") == BUCKET_BYTES
    assert bucket_bytes_for(plan("whole"), "cpu") == BUCKET_BYTES  # auto: eager on the CPU
    eager = plan("whole", recompute={"policy": "selective"})  # auto leaves it eager
    assert bucket_bytes_for(eager, "cuda") == BUCKET_BYTES
    compiled = plan("whole", recompute={"policy": "block"})  # auto compiles it whole
    assert bucket_bytes_for(compiled, "cuda") == LATE_BUCKET_BYTES
