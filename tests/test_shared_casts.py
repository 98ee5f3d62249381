"""Pass ``shared_casts``: one explicit bf16 cast per float32 source, same forward bit for bit."""

from __future__ import annotations

import pytest
import torch

import moec
from moec.passes.base import PassContext
from moec.passes.casts import AUTOCAST_BF16, SharedCastsPass, runtime_dtypes
from moec.plan import Plan
from moec.train import LanguageModelWithLoss
from tests.models import tiny_llama, tokens

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True},
    "precision": {"compute_dtype": "bf16"},
}


def _compile(ids, shared_casts: bool):
    # working_weights reads the casts shared_casts makes: without one, neither runs
    disable = [] if shared_casts else ["shared_casts", "working_weights"]
    torch.manual_seed(0)
    model = LanguageModelWithLoss(tiny_llama())
    return moec.compile(model, PLAN, (ids[:, :-1], ids[:, 1:]), disable=disable)


@pytest.mark.slow  # two compiles and training steps of a bf16 model
def test_one_cast_per_source_and_the_same_step():
    ids = tokens(2, 17)
    fused, plain = (_compile(ids, s) for s in (True, False))
    gm = fused.graph_module
    stats = fused.pass_results["shared_casts"].stats
    assert stats["readers"] > stats["sources_cast"] > 0 and stats["casts_merged"] > 0
    dtypes = runtime_dtypes(gm, "cpu")
    casts: dict = {}
    for node in gm.graph.nodes:
        if node.target == torch.ops.aten._to_copy.default:
            casts.setdefault(node.args[0], []).append(node)
        if node.target in AUTOCAST_BF16:  # every matmul reads bf16 only: autocast casts nothing
            assert all(dtypes[a] != torch.float32 for a in node.all_input_nodes), node.name
    assert all(len(c) == 1 for c in casts.values())
    losses = [c(ids[:, :-1], ids[:, 1:]) for c in (fused, plain)]
    assert torch.equal(losses[0], losses[1])  # the same casts autocast does, in the same places
    grads = [torch.autograd.grad(loss, list(c.parameters())) for loss, c in
             zip(losses, (fused, plain))]  # fmt: skip
    scale = max(b.norm() for b in grads[1])  # some gradients are ~1e-11: noise, not signal
    for a, b in zip(*grads, strict=True):  # bf16 vs float32 summation of the readers' gradients
        assert (a - b).norm() <= 3e-2 * b.norm() + 1e-4 * scale


def test_float32_plans_are_left_alone():
    ids = tokens(2, 9)
    plan = {**PLAN, "precision": {"compute_dtype": "fp32"}}
    compiled = moec.compile(LanguageModelWithLoss(tiny_llama(2)), plan, (ids[:, :-1], ids[:, 1:]))
    assert "shared_casts" not in compiled.pass_results


class _PositionTable(torch.nn.Module):
    """transformers' rotary table (5.17): an outer product of frequencies and positions."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))

    def forward(self, positions):
        inv_freq = self.inv_freq[None, :, None].expand(positions.shape[0], -1, 1)
        return (inv_freq @ positions[:, None, :].float()).transpose(1, 2).cos()


def test_outer_products_stay_float32_under_bf16():
    model, positions = _PositionTable(), torch.randint(0, 4096, (2, 64))
    gm = moec.trace(model, (positions,))
    plan = Plan.from_dict({"precision": {"compute_dtype": "bf16"}})
    result = SharedCastsPass().run(gm, PassContext(plan))
    assert result.stats["outer_products"] == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the runtime runs a bf16 program
        (table,) = gm(positions)
    torch.testing.assert_close(table, model(positions))  # positions above 256 kept exact


@pytest.mark.slow
def test_a_program_captured_on_the_meta_device_gets_the_same_casts():
    """Autocast does not act on meta tensors: the pass propagates a meta capture on the device it
    will run on, so no bf16 value is taken for float32 and cast again."""

    def final_ops(device: str) -> list:
        torch.manual_seed(0)
        with torch.device(device):
            model = LanguageModelWithLoss(tiny_llama())
        ids = tokens(2, 17).to(device)
        compiled = moec.compile(model, PLAN, (ids[:, :-1], ids[:, 1:]))
        stats = compiled.pass_results["shared_casts"].stats
        ops = [n.target for n in compiled.graph_module.graph.nodes if n.op == "call_function"]
        return [stats["sources_cast"], stats["readers"], *ops]

    assert final_ops("meta") == final_ops("cpu")


def _size_checking_attention(q, k, v, *args, **kwargs):
    """SDPA that reads its sequence length, as CUDA's backend choice does."""
    assert q.shape[-2] % 8 == 0  # an alignment check, as the flash kernels make
    return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, *args, **kwargs)


def test_dtype_analysis_adds_no_guard_to_the_program_sizes():
    """The analysis runs at the example's sizes in a fake mode of its own: an op that reads a
    size while it runs (on CUDA, attention choosing its backend by shape) cannot guard, or
    specialize, the program's symbolic batch and sequence sizes."""
    from moec.frontend import capture
    from moec.fx import fake_mode

    program = capture(LanguageModelWithLoss(tiny_llama(2)), (tokens(2, 16), tokens(2, 16)))
    gm = program.graph
    sdpa = gm.graph.find_nodes(
        op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default
    )
    assert sdpa
    for node in sdpa:
        node.target = _size_checking_attention
    shape_env = fake_mode(gm).shape_env
    guards, replacements = len(shape_env.guards), dict(shape_env.replacements)
    dtypes = runtime_dtypes(gm, "cpu")
    assert all(dtypes[n] == torch.bfloat16 for n in sdpa)
    assert len(shape_env.guards) == guards and shape_env.replacements == replacements
