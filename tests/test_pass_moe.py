import pytest
import torch

import moec
from moec.passes.moe import MoEPassError
from moec.passes.verify import VerificationError, verify_graph
from tests.models import HalvedProjection, hf_family, hf_model, tiny_gpt2, tiny_llama, tokens
from tests.test_structure import DenseThenRouted, PlainFFN, PointwiseConvFFN, SharedExpertMoE


def _rel(a, b):
    return (
        float((a - b).norm() / b.norm())
        if a.requires_grad is False
        else _rel(a.detach(), b.detach())
    )


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2, lambda: hf_model("gpt2")])
@pytest.mark.parametrize("shared", [False, True])
def test_upcycle_equals_dense_at_init(make, shared):
    model = make()
    ids = tokens()
    plan = {
        "moe": {
            "num_experts": 4,
            "top_k": 2,
            "init": "upcycle",
            "shared_expert": shared,
            "capacity_factor": None,
        }
    }
    compiled = moec.compile(model, plan, (ids,))
    dense = model(ids)
    out = compiled(ids)
    if not isinstance(dense, torch.Tensor):
        dense, out = dense.logits, out.logits
    assert _rel(out, dense) <= 1e-5


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [False, True])
def test_split_with_all_experts_equals_dense_at_init(make, gating, shared):
    model = make()
    ids = tokens()
    plan = {
        "moe": {
            "num_experts": 4,
            "top_k": 4,
            "init": "split",
            "normalize_weights": False,
            "gating": gating,
            "shared_expert": shared,
            "capacity_factor": None,
        }
    }
    assert _rel(moec.compile(model, plan, (ids,))(ids), model(ids)) <= 1e-5


@pytest.mark.parametrize("init", ["upcycle", "split"])
@pytest.mark.parametrize("up_first", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_a_projection_split_in_halves_becomes_experts_equal_to_it_at_init(init, up_first, shared):
    model, x = HalvedProjection("chunk", up_first), torch.randn(2, 5, 8)
    moe = {"num_experts": 4, "init": init, "shared_expert": shared, "capacity_factor": None}
    moe |= {"top_k": 2} if init == "upcycle" else {"top_k": 4, "normalize_weights": False}
    compiled = moec.compile(model, {"moe": moe}, (x,))
    assert compiled.pass_results["moe"].stats["ffns_replaced"] == 1
    assert _rel(compiled(x), model(x)) <= 1e-5
    names = {n for n, _ in compiled.named_parameters()}
    assert ("gate_up.weight" in names) == shared  # the dense projection only as shared expert


def test_statistics_and_parameter_books():
    model = tiny_llama(layers=4)
    plan = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 2}}
    compiled = moec.compile(model, plan, (tokens(),))
    stats = compiled.pass_results["moe"].stats
    assert stats["ffns_replaced"] == 2 and stats["ffns_kept_dense"] == 2
    dense_ffn = 3 * 32 * 64
    assert stats["params_removed"] == 2 * dense_ffn
    assert stats["params_added"] == 2 * (4 * dense_ffn + 4 * 32)
    names = dict(compiled.named_parameters())
    assert names["layers.2.ffn.moe.w_up"].shape == (4, 32, 128)
    assert names["layers.3.ffn.moe.w_down"].shape == (4, 64, 32)
    assert "layers.2.ffn.down_proj.weight" not in names
    assert "layers.1.ffn.down_proj.weight" in names
    assert len(compiled.moe_layers) == 2


def test_random_init_uses_planned_width_and_users_model_is_untouched():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = {
        "moe": {
            "num_experts": 4,
            "top_k": 1,
            "init": "random",
            "expert_width": 16,
            "shared_expert": True,
        }
    }
    compiled = moec.compile(model, plan, (tokens(),))
    w_down = compiled.graph_module.get_parameter("layers.0.ffn.moe.w_down")
    assert w_down.shape == (4, 16, 32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_split_width_must_divide():
    with pytest.raises(moec.PlanError, match="moe.num_experts"):
        moec.compile(
            tiny_llama(), {"moe": {"num_experts": 5, "top_k": 1, "init": "split"}}, (tokens(),)
        )


def test_model_without_ffn_says_why():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(MoEPassError, match="no FFN region"):
        moec.compile(model, None, (torch.randn(2, 3, 8),))


class InPlaceResidual(torch.nn.Module):
    """An FFN whose output the model adds to in place (Falcon's ``mlp_output += ...``)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        y += x
        return y


@pytest.mark.parametrize("shared", [False, True])
def test_the_moe_output_takes_an_in_place_add_and_trains(shared):
    model, x = InPlaceResidual(), torch.randn(2, 5, 8)
    moe = {"num_experts": 4, "top_k": 2, "capacity_factor": None, "shared_expert": shared}
    compiled = moec.compile(model, {"moe": moe}, (x,))
    out = compiled(x)
    assert _rel(out, model(x)) <= 1e-5
    out.square().sum().backward()
    grads = [p.grad for p in compiled.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


class RoutedAlready(torch.nn.Module):
    """A block that routes tokens itself (top-2 of 4 experts, each a plain matrix)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2)
        picked = self.experts[chosen]  # [B, S, 2, 8, 8]
        return x + (weights[..., None] * torch.einsum("bsd,bskde->bske", x, picked)).sum(2)


def test_a_model_that_routes_already_is_told_to_bring_its_dense_form():
    with pytest.raises(MoEPassError, match=r"already routes tokens \(aten.topk at node topk\)"):
        moec.compile(RoutedAlready(), None, (torch.randn(2, 3, 8),))


def test_a_family_with_a_learned_activation_is_told_which_parameters_stop_it():
    model = hf_family("apertus")
    with pytest.raises(MoEPassError, match=r"reads model.layers.0.mlp.act_fn.alpha_n, .*free"):
        moec.compile(model, None, (tokens(),))


def test_a_family_with_a_norm_inside_its_ffns_is_told_which():
    model = hf_family("bitnet")
    with pytest.raises(MoEPassError, match=r"mean.dim \(model.layers.0.mlp.ffn_sub_norm\) runs"):
        moec.compile(model, None, (tokens(),))


def test_blocks_that_route_already_are_kept_and_their_shared_experts_too():
    """Only the dense FFN becomes routed experts, with a warning naming what was kept; the
    program still computes the model's function (upcycled at init)."""
    model, x = DenseThenRouted(), torch.randn(2, 4, 8)
    plan = {"moe": {"num_experts": 4, "top_k": 2, "capacity_factor": None}}
    with pytest.warns(UserWarning, match=r"shared experts moe \(beside aten.topk in moe\)"):
        compiled = moec.compile(model, plan, (x,))
    stats = compiled.pass_results["moe"].stats
    assert stats["ffns_replaced"] == 1 and stats["ffns_beside_routers"] == 1
    assert [layer.path for layer in compiled.moe_layers] == ["dense.moe"]
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(MoEPassError, match=r"no dense FFN to convert in SharedExpertMoE"):
        moec.compile(SharedExpertMoE(), plan, (x,))


def test_a_family_with_moe_layers_keeps_them():
    model = hf_family("afmoe")  # layer 0 dense; layer 1 routed, with a shared expert
    with pytest.warns(UserWarning, match=r"model.layers.1.mlp.shared_experts \(beside"):
        compiled = moec.compile(model, None, (tokens(),))
    assert compiled.pass_results["moe"].stats["ffns_replaced"] == 1


def test_verifier_catches_a_wrong_shape_and_an_orphan_parameter():
    compiled = moec.compile(tiny_llama(), None, (tokens(),))
    gm = compiled.graph_module
    verify_graph(gm, "ok")
    route = next(n for n in gm.graph.nodes if n.target == torch.ops.moec.combine.default)
    route.meta["val"] = route.meta["val"][..., :3]
    with pytest.raises(VerificationError, match="disagrees"):
        verify_graph(gm, "broken")
    route.meta["val"] = None
    gm.register_parameter("orphan", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(VerificationError, match="orphan"):
        verify_graph(gm, "broken")


def test_capacity_drops_are_reported():
    compiled = moec.compile(
        tiny_llama(), {"moe": {"num_experts": 4, "top_k": 2, "capacity_factor": 0.5}}, (tokens(),)
    )
    compiled(tokens(4, 32))
    for layer in compiled.routing_stats().values():
        assert layer["accepted"] <= layer["offered"] == 4 * 32 * 2
        assert layer["drop_rate"] >= 0.5 - 1e-9
        assert 0 < layer["capacity_use"] <= 1


def test_compiled_model_lets_go_of_the_replaced_dense_weights():
    """After capture the compiled model holds no reference to its source: once the caller drops
    the dense model, the FFN weights the moe pass replaced are freed."""
    import gc
    import weakref

    model = tiny_llama()
    replaced = weakref.ref(model.layers[1].ffn.up_proj.weight)
    kept = model.embed.weight  # the program reads it: it stays
    compiled = moec.compile(model, {"moe": {"num_experts": 4, "top_k": 2}}, (tokens(),))
    del model
    gc.collect()
    assert replaced() is None
    assert any(p is kept for p in compiled.parameters())
    with pytest.raises(moec.MoecError, match="captured already"):
        compiled.capture((tokens(),), {})


def _quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def _squared_relu(x):
    return torch.relu(x) ** 2


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: PointwiseConvFFN(torch.nn.Conv1d), (2, 8, 6)),
        (lambda: PointwiseConvFFN(torch.nn.Conv2d), (2, 8, 3, 4)),
        (lambda: PlainFFN(_quick_gelu), (2, 6, 8)),
        (lambda: PlainFFN(_squared_relu, gated=True), (2, 6, 8)),
    ],
)
def test_broader_ffns_upcycle_to_the_dense_function_and_train(make, shape):
    model = make()
    plan = {"moe": {"num_experts": 3, "top_k": 3, "capacity_factor": None}}
    compiled = moec.compile(model, plan, (torch.randn(shape),))
    x = torch.randn(shape)
    out = compiled(x)
    assert out.shape == x.shape and _rel(out, model(x)) <= 1e-5
    out.square().sum().backward()
    grads = [p.grad for name, p in compiled.named_parameters() if "moe.w_" in name]
    assert len(grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in grads)


class DropoutFFNs(torch.nn.Module):
    """Two residual FFN blocks, each ``down(dropout(relu(up(x))))`` with its own rate."""

    def __init__(self, rates: tuple[float, float]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "up": torch.nn.Linear(8, 16),
                    "drop": torch.nn.Dropout(p),
                    "down": torch.nn.Linear(16, 8),
                }
            )
            for p in rates
        )

    def forward(self, x):
        for b in self.blocks:
            x = x + b["down"](b["drop"](torch.relu(b["up"](x))))
        return x


def _dropout_rates(compiled) -> list[float]:
    graph = compiled.graph_module.graph
    return [n.args[1] for n in graph.nodes if n.target == torch.ops.aten.dropout.default]


def test_ffn_dropout_is_refused_naming_the_module_and_rate():
    model = DropoutFFNs((0.0, 0.1)).train()
    with pytest.raises(
        MoEPassError, match=r"FFN blocks\.1 applies dropout p=0\.1 \(blocks\.1\.drop\)"
    ):
        moec.compile(model, {"moe": {"num_experts": 2}}, (torch.randn(2, 5, 8),))


def test_ffn_dropout_dropped_only_on_request_and_counted():
    model = DropoutFFNs((0.0, 0.1)).train()
    plan = {"moe": {"num_experts": 2, "ffn_dropout": "drop"}}
    compiled = moec.compile(model, plan, (torch.randn(2, 5, 8),))
    assert compiled.pass_results["moe"].stats["ffn_dropouts_dropped"] == 1
    assert all(p == 0 for p in _dropout_rates(compiled))


def test_dense_first_ffn_keeps_its_dropout():
    model = DropoutFFNs((0.1, 0.0)).train()
    plan = {"moe": {"num_experts": 2, "top_k": 2, "dense_first": 1, "capacity_factor": None}}
    compiled = moec.compile(model, plan, (torch.randn(2, 5, 8),))
    assert compiled.pass_results["moe"].stats["ffn_dropouts_dropped"] == 0
    assert 0.1 in _dropout_rates(compiled)
    x = torch.randn(4, 16, 8)
    assert not torch.equal(compiled(x), compiled(x))  # the dense block still drops units
