"""Upcycling variants of the ``moe`` pass (``moe.init``): granular upcycling's expert layout,
its limits (G = 1 is ``upcycle``, G = num_experts is ``split``) and its first forward, and
Drop-Upcycling's re-initialised units."""

from __future__ import annotations

import math

import pytest
import torch

import moec
from tests.models import hf_model, tiny_gpt2, tiny_llama, tokens

N = 4
HIDDEN = 64  # the tiny models' FFN width


def _ffn(model: torch.nn.Module, layer: int) -> tuple[list[torch.nn.Linear], torch.nn.Linear]:
    """The up projections (gate first) and the down projection of ``layer``'s dense FFN."""
    if hasattr(model, "layers"):  # moec's Llama
        ffn = model.layers[layer].ffn
        return [ffn.gate_proj, ffn.up_proj], ffn.down_proj
    ffn = model.blocks[layer].mlp  # moec's GPT-2
    return [ffn.fc], ffn.proj


def _prefix(model: torch.nn.Module, layer: int) -> str:
    return f"layers.{layer}.ffn.moe" if hasattr(model, "layers") else f"blocks.{layer}.mlp.moe"


def _compile(model: torch.nn.Module, **moe) -> moec.CompiledModel:
    plan = {"moe": {"num_experts": N, "top_k": 2, "seed": 5, **moe}}
    return moec.compile(model, plan, (tokens(),))


def _params(compiled) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in compiled.graph_module.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize(
    "make,granularity,scale",
    [(tiny_llama, 1, 1.0), (tiny_llama, 2, 2.0), (tiny_llama, 4, 2.0), (tiny_gpt2, 2, 2.0)],
)
def test_granular_experts_hold_slice_e_mod_g_scaled(make, granularity, scale):
    """Expert e is slice e mod G of the dense hidden units, its down projection scaled (G for
    several groups; 1 / w0 = top_k for the single group of G = N, split's rule) and its down
    bias by scale / G; a virtual group of G experts shares a router row (zero for one group)."""
    model = make(layers=2)
    params = _params(_compile(model, upcycle_granularity=granularity))
    width = HIDDEN // granularity
    for layer in range(2):
        ups, down = _ffn(model, layer)
        moe = {
            k.rpartition(".")[2]: v
            for k, v in params.items()
            if k.startswith(_prefix(model, layer))
        }
        for e in range(N):
            units = slice((e % granularity) * width, (e % granularity + 1) * width)
            want_up = torch.cat([u.weight[units].detach().t() for u in ups], 1)
            assert torch.equal(moe["w_up"][e], want_up), (layer, e)
            assert torch.equal(moe["w_down"][e], down.weight[:, units].detach().t() * scale)
            if down.bias is not None:
                want_b_up = torch.cat([u.bias[units].detach() for u in ups])
                assert torch.equal(moe["b_up"][e], want_b_up)
                assert torch.equal(moe["b_down"][e], down.bias.detach() * (scale / granularity))
        router = moe["router_weight"]
        if granularity == N:
            assert not router.any()
        else:
            groups = router.view(N // granularity, granularity, -1)
            assert torch.equal(groups, groups[:, :1].expand_as(groups))
            assert len({tuple(row.tolist()) for row in groups[:, 0]}) == N // granularity


@pytest.mark.parametrize(
    "make,gating,normalize,shared",
    [
        (tiny_llama, "softmax", True, False),
        (tiny_llama, "sigmoid", False, True),
        (tiny_gpt2, "softmax", False, True),  # biases
    ],
)
def test_granularity_num_experts_is_split(make, gating, normalize, shared):
    torch.manual_seed(0)
    model = make(layers=1)
    moe = {"gating": gating, "normalize_weights": normalize, "shared_expert": shared}
    granular = _params(_compile(model, init="upcycle", upcycle_granularity=N, **moe))
    split = _params(_compile(model, init="split", **moe))
    assert granular.keys() == split.keys()
    for name, value in split.items():
        assert torch.equal(granular[name], value), name


@pytest.mark.parametrize(
    "make,num_experts,granularity,top_k,shared",
    [
        (tiny_llama, 4, 2, 2, False),
        (tiny_gpt2, 4, 2, 2, True),  # biases, and the shared expert's half
        pytest.param(lambda: hf_model("llama"), 8, 4, 4, False, marks=pytest.mark.slow),
        (tiny_llama, 8, 2, 4, True),  # two whole groups of two
    ],
)
def test_granular_first_forward_equals_the_dense_model(
    make, num_experts, granularity, top_k, shared
):
    """fp32, dropless, normalized weights, top_k a multiple of G: the MoE is the dense model."""
    torch.manual_seed(0)
    model, ids = make(), tokens()
    moe = {
        "num_experts": num_experts,
        "top_k": top_k,
        "upcycle_granularity": granularity,
        "shared_expert": shared,
        "capacity_factor": None,
    }
    compiled = moec.compile(model, {"moe": moe}, (ids,))
    dense, out = model(ids), compiled(ids)
    if not isinstance(dense, torch.Tensor):
        dense, out = dense.logits, out.logits
    assert _rel(out, dense) <= 1e-5


def _perturbed_llama() -> torch.nn.Module:
    """A tiny Llama whose FFN matrices have distinct, non-zero means and stds."""
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    with torch.no_grad():
        for layer in range(2):
            (gate, up), down = _ffn(model, layer)
            gate.weight.mul_(3).add_(0.1)
            up.weight.add_(-0.05)
            down.weight.mul_(2)
    return model


def _changed_units(got: torch.Tensor, dense: torch.Tensor) -> set[int]:
    """The units (rows of [units, D] matrices) where ``got`` differs from ``dense``; a changed
    unit differs in every entry (the whole unit is redrawn)."""
    differs = got != dense
    changed = differs.any(1)
    assert torch.equal(differs[changed], torch.ones_like(differs[changed]))
    return set(torch.arange(len(got))[changed].tolist())


@pytest.mark.parametrize("ratio,granularity", [(0.25, 1), (0.5, 2), (1.0, 1)])
def test_drop_upcycling_redraws_a_seeded_share_of_each_experts_units(ratio, granularity):
    model = _perturbed_llama()
    compiled = _compile(
        model, init="drop_upcycle", drop_upcycle_ratio=ratio, upcycle_granularity=granularity
    )
    params = _params(compiled)
    width = HIDDEN // granularity
    count = math.floor(ratio * width + 0.5)
    for layer in range(2):
        (gate, up), down = _ffn(model, layer)
        w_up = params[f"layers.{layer}.ffn.moe.w_up"]
        w_down = params[f"layers.{layer}.ffn.moe.w_down"] / granularity  # the granular scale
        redrawn = {"gate": [], "up": [], "down": []}
        dropped = []
        for e in range(N):
            units = slice((e % granularity) * width, (e % granularity + 1) * width)
            pairs = {
                "gate": (w_up[e][:, :width].t(), gate.weight[units]),
                "up": (w_up[e][:, width:].t(), up.weight[units]),
                "down": (w_down[e], down.weight[:, units].t()),
            }
            sets = {name: _changed_units(got, want.detach()) for name, (got, want) in pairs.items()}
            assert sets["gate"] == sets["up"] == sets["down"], (layer, e)  # whole neurons
            assert len(sets["gate"]) == count, (layer, e, len(sets["gate"]), count)
            dropped.append(frozenset(sets["gate"]))
            for name, (got, _) in pairs.items():
                redrawn[name].append(got[sorted(sets["gate"])])
        if count < width:  # a different subset per expert
            assert len(set(dropped)) == N, layer
        for name, dense in (("gate", gate.weight), ("up", up.weight), ("down", down.weight)):
            values, dense = torch.cat(redrawn[name]), dense.detach()
            assert abs(float(values.mean() - dense.mean())) < 0.1 * float(dense.std()), name
            assert abs(float(values.std() / dense.std()) - 1) < 0.1, name


def test_drop_upcycling_keeps_biases_and_ratio_zero_is_upcycle():
    torch.manual_seed(0)
    model = tiny_gpt2(layers=1)
    upcycled = _params(_compile(model, init="upcycle"))
    unchanged = _params(_compile(model, init="drop_upcycle", drop_upcycle_ratio=0.0))
    assert unchanged.keys() == upcycled.keys()
    for name, value in unchanged.items():
        assert torch.equal(value, upcycled[name]), name
    dropped = _params(_compile(model, init="drop_upcycle"))
    for name, value in upcycled.items():
        same = torch.equal(dropped[name], value)
        assert same == (not name.endswith(("w_up", "w_down"))), name


@pytest.mark.parametrize(
    "moe,field,accepted",
    [
        ({"upcycle_granularity": 3}, "moe.upcycle_granularity", "a divisor of moe.num_experts=4"),
        ({"upcycle_granularity": 0}, "moe.upcycle_granularity", "an integer >= 1"),
        ({"init": "split", "upcycle_granularity": 2}, "moe.upcycle_granularity", "1 for init"),
        ({"init": "random", "upcycle_granularity": 2}, "moe.upcycle_granularity", "1 for init"),
        (
            {"init": "drop_upcycle", "drop_upcycle_ratio": 1.5},
            "moe.drop_upcycle_ratio",
            "a number in [0, 1]",
        ),
        ({"drop_upcycle_ratio": float("nan")}, "moe.drop_upcycle_ratio", "a number in [0, 1]"),
    ],
)
def test_impossible_upcycling_fields_are_refused_by_name(moe, field, accepted):
    with pytest.raises(moec.PlanError) as info:
        moec.Plan.from_dict({"moe": {"num_experts": N, **moe}})
    assert info.value.field == field
    assert info.value.allowed.startswith(accepted), info.value.allowed


@pytest.mark.parametrize(
    "moe,field",
    [
        # 6 experts, G = 3: a divisor of num_experts but not of the FFN width 64
        ({"num_experts": 6, "upcycle_granularity": 3}, "moe.upcycle_granularity"),
        ({"upcycle_granularity": 2, "expert_width": 64}, "moe.expert_width"),
    ],
)
def test_granularity_is_checked_against_the_ffn_width(moe, field):
    with pytest.raises(moec.PlanError, match=r"FFN layers\.0\.ffn") as info:
        _compile(tiny_llama(), **moe)
    assert info.value.field == field
