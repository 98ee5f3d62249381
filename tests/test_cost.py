"""The symbolic cost model against hand-computed FLOPs, at more than one batch/sequence size."""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import moec
from moec.analysis.cost import backward_workspace, graph_cost, node_cost
from moec.models import Llama, LlamaConfig

aten = torch.ops.aten
SIZES = [dict(batch=2, seq=8), dict(batch=3, seq=40)]


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        return self.proj(x)


class Attention(nn.Module):
    """Self-attention of x (B, S, 64) as 4 heads of 16, without projections."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, x):
        b, s, _ = x.shape
        q = x.view(b, s, 4, 16).transpose(1, 2)  # (B, H, S, Dh)
        return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal)


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


@pytest.mark.parametrize("sizes", SIZES)
def test_linear_flops_are_2mnk_and_save_the_input(sizes):
    gm = moec.trace(OneLinear(), (torch.randn(2, 8, 16),))
    cost = graph_cost(gm)
    b, s = sizes["batch"], sizes["seq"]
    report = cost.evaluate(**sizes)
    assert report.matmul_flops == 2 * b * s * 16 * 32
    assert report.train_flops == 3 * report.matmul_flops
    assert report.tokens == b * s  # float input: all-but-last dims
    (linear,) = _nodes(gm, aten.linear.default)
    assert cost.value(node_cost(linear).saved_bytes, **sizes) == 4 * b * s * 16
    assert cost.value(node_cost(linear).bytes_out, **sizes) == 4 * b * s * 32
    assert report.params == 16 * 32 + 32
    # backward: d_out, d_x, d_weight, d_bias live together
    workspace = 4 * (b * s * 32 + b * s * 16 + 16 * 32 + 32)
    assert cost.value(backward_workspace(linear), **sizes) == workspace


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_are_4bhssd_halved_when_causal(causal):
    cost = graph_cost(moec.trace(Attention(causal), (torch.randn(2, 8, 64),)))
    for b, s in [(2, 8), (3, 24)]:
        expected = 4 * b * 4 * s * s * 16 // (2 if causal else 1)
        assert cost.evaluate(batch=b, seq=s).matmul_flops == expected


def _tiny_llama(layers=2, dim=32, heads=4, kv_heads=2, ffn=64, vocab=256):
    cfg = LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_hidden=ffn,
    )
    return Llama(cfg), cfg


def _llama_matmul_flops(cfg: LlamaConfig, b: int, s: int) -> int:
    d, dh = cfg.dim, cfg.dim // cfg.n_heads
    per_token = (
        cfg.n_layers
        * (
            2 * d * d * 2  # q and o projections
            + 2 * d * cfg.n_kv_heads * dh * 2  # k and v
            + 2 * d * cfg.ffn_hidden * 3  # gate, up, down
        )
        + 2 * d * cfg.vocab_size
    )  # lm head
    attention = cfg.n_layers * 2 * b * cfg.n_heads * s * s * dh  # causal: half of 4*B*H*S*S*Dh
    return b * s * per_token + attention


def test_small_model_flops_match_hand_count_at_two_sizes():
    model, cfg = _tiny_llama()
    cost = graph_cost(moec.trace(model, (torch.randint(0, 256, (2, 16)),)))
    assert set(cost.dims) == {"batch", "seq"}
    for sizes in SIZES:
        report = cost.evaluate(**sizes)
        assert report.matmul_flops == _llama_matmul_flops(cfg, sizes["batch"], sizes["seq"])
        assert report.tokens == sizes["batch"] * sizes["seq"]
    assert cost.evaluate().sizes == {"batch": 2, "seq": 16}
    assert len(cost.blocks) == cfg.n_layers
    assert [b.ffn.path for b in cost.blocks] == ["layers.0.ffn", "layers.1.ffn"]
    ffn_flops = cost.value(cost.blocks[0].ffn_cost.matmul_flops, batch=3, seq=5)
    assert ffn_flops == 3 * 5 * 2 * cfg.dim * cfg.ffn_hidden * 3
    assert cost.params == sum(p.numel() for p in model.parameters())
    assert cost.active_params == cost.params


def test_moe_graph_counts_routed_rows_and_active_params():
    model, cfg = _tiny_llama()
    plan = moec.Plan.from_dict({"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1}})
    compiled = moec.compile(model, plan, example_inputs=(torch.randint(0, 256, (2, 16)),))
    gm = compiled.graph_module
    cost = graph_cost(compiled.program)
    (mlp,) = _nodes(gm, torch.ops.moec.expert_mlp.default)
    b, s, k, d, h = 3, 10, 2, cfg.dim, cfg.ffn_hidden
    assert cost.value(node_cost(mlp).flops, batch=b, seq=s) == 2 * b * s * k * (d * 2 * h + h * d)
    # d_y, d_buffer, d_w_up, d_w_down, and inside: d_h [R, 2H] and the activation [R, H]
    rows, e = b * s * k, 4
    grads = rows * d * 2 + e * (d * 2 * h + h * d) + rows * 3 * h
    assert cost.value(backward_workspace(mlp), batch=b, seq=s) == 4 * grads
    expert = sum(
        p.numel() for name, p in gm.named_parameters() if compiled.program.role(name) == "expert"
    )
    assert cost.params == sum(p.numel() for p in gm.parameters())
    assert cost.active_params == cost.params - expert + expert * 2 // 4
    kinds = [b.ffn.num_experts for b in cost.blocks]
    assert kinds == [0, 4]  # the first block stays dense
    assert cost.blocks[1].active_params < cost.blocks[1].params
    # upcycled top-2 of copies: the MoE FFN does K times the dense FFN's matmul work
    dense_ffn = cost.value(cost.blocks[0].ffn_cost.matmul_flops, batch=b, seq=s)
    moe_ffn = cost.value(cost.blocks[1].ffn_cost.matmul_flops, batch=b, seq=s)
    router = 2 * b * s * d * 4
    assert moe_ffn == k * dense_ffn + router


def test_unknown_size_name_is_an_error():
    cost = graph_cost(moec.trace(OneLinear(), (torch.randn(2, 8, 16),)))
    with pytest.raises(KeyError, match="unknown size"):
        cost.evaluate(heads=3)


@pytest.mark.parametrize("gemm", ["fp8_rowwise", "mxfp8"])
def test_low_precision_gemms_count_the_same_work(gemm):
    """The quantized ops do the GEMMs of the ops they replace: same FLOPs and kinds, so useful
    MFU and the time model see a low-precision program's work (they once counted it as zero)."""
    model, _ = _tiny_llama()
    example = (torch.randint(0, 256, (2, 16)),)
    costs = {}
    for precision in ("bf16", gemm):
        plan = moec.Plan.from_dict(
            {
                "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True},
                "precision": {
                    "gemm": precision,
                    "scope": [
                        "routed_experts",
                        "shared_expert",
                        "attn_qkv",
                        "attn_out",
                        "dense_ffn",
                    ],
                },
            }
        )
        costs[precision] = graph_cost(moec.compile(model, plan, example_inputs=example).program)

    def quantized(node) -> bool:
        if node.target == torch.ops.moec.expert_mlp.default:
            return node.args[7:8] == (gemm,)  # the recipe
        return node.target == torch.ops.moec.quantized_linear.default

    quantized = [n for n in costs[gemm].nodes if quantized(n)]
    assert {str(n.target) for n in quantized} == {
        "moec.expert_mlp.default",
        "moec.quantized_linear.default",
    }
    assert {costs[gemm].nodes[n].kind for n in quantized} == {"experts", "matmul"}
    for sizes in SIZES:
        low, high = costs[gemm].evaluate(**sizes), costs["bf16"].evaluate(**sizes)
        assert low.matmul_flops == high.matmul_flops
        assert low.train_flops == high.train_flops


@pytest.mark.parametrize("poison", [(), (float("nan"),)], ids=["no-poison", "poison-by-position"])
@pytest.mark.parametrize("path", ["a2a_capacity", "rowwise"])
def test_ep_combine_saves_what_its_backward_reads(path, poison):
    """The a2a paths keep the picked rows home ([T*K, D]); rowwise keeps the route weights on
    the experts' side ([R], float32) and the expert output y ([R, D]) its backward reads. The
    path is read by name, wherever the call passes the arguments after it."""
    tokens, top_k, rows, dim = 6, 2, 20, 16
    graph = fx.Graph()
    with FakeTensorMode():
        values = {
            "y": torch.empty(rows, dim, dtype=torch.bfloat16),
            "weights": torch.empty(tokens, top_k),
            "slots": torch.empty(tokens, top_k, dtype=torch.int64),
            "recv_rows": torch.empty(rows, dtype=torch.int64),
            "sent": torch.empty(2, dtype=torch.int64),
            "counts": torch.empty(2, 4, dtype=torch.int64),
        }
        args = []
        for name, val in values.items():
            args.append(graph.placeholder(name))
            args[-1].meta["val"] = val
        op = torch.ops.moec.ep_combine.default
        combine = graph.call_function(op, (*args, "group", 2, path, *poison))
        combine.meta["val"] = op(*values.values(), "group", 2, path, *poison)
    saved = int(node_cost(combine).saved_bytes)
    if path == "rowwise":
        assert saved == rows * 4 + rows * dim * 2
    else:
        assert saved == tokens * top_k * dim * 2
