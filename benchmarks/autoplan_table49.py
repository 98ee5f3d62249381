"""The plans ``moec plan auto`` picks for the report's Table 49 models, beside the report's own.

For each row of the report's production-throughput matrix (Table 49: Tiny-64E ... Ultra-256E on
16 / 128 / 512 B300s, sequence 8192, top-4 routing, one shared expert) this builds the model as a
moec :class:`~moec.models.Llama` on the meta device (the leading dense blocks + three MoE blocks),
captures it once, grows the profile to full depth (:meth:`ModelProfile.repeat_block`), and runs
the plan search at the row's world size and global batch. It prints, per row, the report's
topology and Table 50 TFLOP/s/GPU, the search's best plan with its predicted step breakdown,
TFLOP/s/GPU and per-rank memory, and the report's own topology evaluated by the same time and
memory model (its dense-DP / EP / PP degrees, rank microbatch, recompute and precision fixed; the
knobs the report does not state, the search's best).

Model sizes: vocab 100352, head dim 128, grouped-query attention (4 query heads per KV head; 8 KV
heads for Ultra), routed and shared experts ``h`` wide, SwiGLU. ``d * h`` follows from the
report's total minus active parameters (only the unrouted share of the routed experts), the
leading dense blocks' FFN width from the active count; :data:`MODELS` checks both within 2%.

TFLOP/s/GPU is Table 51's useful-model rate: 3x the forward FLOPs of the cost model (every
matmul, the routed experts at top-k rows per token, causal attention; no recompute) per token,
times tokens per step, over step time and GPU count. Everything is a prediction of the
uncalibrated time model (:mod:`moec.analysis.cost.time` defaults, H200-derived), not measured.

    python -m benchmarks.autoplan_table49 [--rows tiny-ep8,ultra-256e] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Iterator

import torch

from moec.analysis.gpus import gpu_spec
from moec.analysis.rank_memory import GIB
from moec.autoplan import ModelProfile, NoPlanFitsError, Prediction, Request, Search
from moec.autoplan.cli import _one_rank
from moec.autoplan.profile import profile_program
from moec.compiler import build_program
from moec.debug import with_next_token_loss
from moec.models.llama import Llama, LlamaConfig
from moec.plan import Plan

SEQ = 8192
VOCAB = 100352
MI = 2**20
CAPTURED_MOE_LAYERS = 3
"""MoE blocks captured: the pipeline units are [embed + dense + first MoE], middle, [last + head];
the middle one is repeated to full depth."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    dim: int
    expert_width: int
    heads: int
    kv_heads: int
    layers: int
    dense_first: int
    dense_width: int
    experts: int
    report_active: float
    report_total: float


MODELS = {
    "Tiny-64E": ModelSpec(2048, 2048, 16, 4, 16, 1, 10240, 64, 1.59e9, 12.91e9),
    "Small-64E": ModelSpec(2560, 2560, 20, 5, 32, 1, 25856, 64, 4.29e9, 40.86e9),
    "Medium-64E": ModelSpec(3072, 3072, 24, 6, 39, 2, 32000, 64, 7.37e9, 70.22e9),
    "Medium-96E": ModelSpec(3072, 3072, 24, 6, 39, 2, 32000, 96, 7.38e9, 103.75e9),
    "Medium-128E": ModelSpec(3072, 3072, 24, 6, 39, 2, 32000, 128, 7.38e9, 137.27e9),
    "Large-128E": ModelSpec(4096, 4096, 32, 8, 47, 2, 40704, 128, 15.14e9, 295.99e9),
    "Ultra-128E": ModelSpec(8192, 6144, 64, 8, 63, 2, 22016, 128, 58.36e9, 1200e9),
    "Ultra-256E": ModelSpec(8192, 6144, 64, 8, 63, 2, 22016, 256, 58.41e9, 2380e9),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One Table 49 row and its Table 50 headline (or only) TFLOP/s/GPU."""

    key: str
    config: str
    model: str
    world: int
    gbs_mi: int
    rank_micro_tokens: int
    dense_dp: int
    expert_dp: int
    ep: int
    pp: int
    gemm: str
    recompute: str
    ep_path: str
    report_tflops: int
    note: str


ROWS = [
    Row(
        "tiny",
        "Tiny-64E, no EP",
        "Tiny-64E",
        16,
        8,
        65536,
        16,
        16,
        1,
        1,
        "bf16",
        "none",
        "auto",
        903,
        "random",
    ),
    Row(
        "tiny-ep8",
        "Tiny-64E, EP8",
        "Tiny-64E",
        16,
        8,
        65536,
        16,
        2,
        8,
        1,
        "bf16",
        "none",
        "rowwise",
        820,
        "learned",
    ),
    Row(
        "small-24",
        "Small-64E, 24 Mi",
        "Small-64E",
        128,
        24,
        24576,
        128,
        16,
        8,
        1,
        "bf16",
        "none",
        "rowwise",
        841,
        "random",
    ),
    Row(
        "small-16",
        "Small-64E, 16 Mi",
        "Small-64E",
        128,
        16,
        16384,
        128,
        16,
        8,
        1,
        "bf16",
        "none",
        "rowwise",
        821,
        "random",
    ),
    Row(
        "medium-64e",
        "Medium-64E",
        "Medium-64E",
        128,
        16,
        16384,
        64,
        8,
        8,
        2,
        "bf16",
        "none",
        "rowwise",
        853,
        "random",
    ),
    Row(
        "medium-96e",
        "Medium-96E",
        "Medium-96E",
        128,
        24,
        16384,
        64,
        8,
        8,
        2,
        "bf16",
        "none",
        "rowwise",
        855,
        "random",
    ),
    Row(
        "medium-128e",
        "Medium-128E",
        "Medium-128E",
        128,
        24,
        16384,
        32,
        4,
        8,
        4,
        "bf16",
        "none",
        "rowwise",
        843,
        "random",
    ),
    Row(
        "large-pp4",
        "Large-128E, PP4",
        "Large-128E",
        512,
        32,
        8192,
        128,
        16,
        8,
        4,
        "bf16",
        "none",
        "rowwise",
        768,
        "random",
    ),
    Row(
        "large-pp8",
        "Large-128E, PP8",
        "Large-128E",
        512,
        24,
        8192,
        64,
        8,
        8,
        8,
        "bf16",
        "none",
        "rowwise",
        757,
        "random",
    ),
    Row(
        "ultra-128e",
        "Ultra-128E",
        "Ultra-128E",
        512,
        64,
        8192,
        64,
        8,
        8,
        8,
        "mxfp8",
        "block",
        "rowwise",
        858,
        "random",
    ),
    # DeepEP v2 in the report; rowwise is moec's nearest sync-free path in the time model
    Row(
        "ultra-256e",
        "Ultra-256E",
        "Ultra-256E",
        512,
        64,
        16384,
        64,
        2,
        32,
        8,
        "mxfp8",
        "block",
        "rowwise",
        689,
        "random, 9 steps",
    ),
]


def build_profile(spec: ModelSpec) -> ModelProfile:
    """Capture the model with its dense blocks and three MoE blocks, then repeat the middle MoE
    block to full depth."""
    layers = spec.dense_first + CAPTURED_MOE_LAYERS
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        dim=spec.dim,
        n_layers=layers,
        n_heads=spec.heads,
        n_kv_heads=spec.kv_heads,
        ffn_hidden=spec.expert_width,
        ffn_hidden_per_layer=(spec.dense_width,) * spec.dense_first
        + (spec.expert_width,) * CAPTURED_MOE_LAYERS,
        max_seq_len=128,
    )
    plan = Plan.from_dict(
        {
            "moe": {
                "num_experts": spec.experts,
                "top_k": 4,
                "expert_width": spec.expert_width,
                "init": "random",
                "shared_expert": True,
                "dense_first": spec.dense_first,
            },
            "precision": {"compute_dtype": "bf16"},
        }
    )
    programs = []
    for parallel in ({}, {"dp": 2, "dp_shard": 2}):  # one rank, and FSDP to learn its groups
        with torch.device("meta"):
            model = Llama(cfg)
            tokens = torch.zeros(2, 64, dtype=torch.long)  # batch != seq: size_roles needs it
        model, inputs = with_next_token_loss(model, (tokens,), {}, "llama")
        programs.append(build_program(model, _one_rank(plan, **parallel), inputs, {}, verify=False))
    profile = profile_program(*programs)
    if profile.num_blocks != layers:
        raise RuntimeError(f"expected {layers} blocks, the capture has {profile.num_blocks}")
    return profile.repeat_block(spec.dense_first + 1, spec.layers)  # the middle MoE block


def param_counts(profile: ModelProfile) -> tuple[float, float]:
    """(active, total) parameters: an expert parameter counts top_k / num_experts of itself."""
    active = total = 0.0
    for unit in profile.units:
        share = unit.moe[0].top_k / unit.moe[0].num_experts if unit.moe else 1.0
        for p in unit.params:
            total += p.numel
            active += p.numel * (share if p.expert else 1.0)
    return active, total


def flops_per_token(profile: ModelProfile) -> float:
    """Useful training FLOPs per token at SEQ (see module)."""
    return 3 * sum(
        f(1, SEQ) / SEQ
        for u in profile.units
        for f in (u.matmul_flops, u.attention_flops, u.expert_flops)
    )


class FixedTopology(Search):
    """The search restricted to the report's pp and EP degree."""

    def __init__(self, profile: ModelProfile, request: Request, pp: int, ep: int):
        super().__init__(profile, request)
        self.pp, self.ep = pp, ep

    def layouts(self) -> Iterator[tuple[int, int, str, int, int, int]]:
        for lay in super().layouts():
            if lay[0] == self.pp and lay[4] == self.ep:
                yield lay


def report_layout(profile: ModelProfile, request: Request, row: Row) -> tuple[Prediction, bool]:
    """The report's layout (pp, EP, rank microbatch, recompute, GEMM precision, EP path fixed;
    FSDP shard, schedule and EP overlap the fastest fitting) and whether it fits."""
    micro = row.rank_micro_tokens // SEQ
    search = FixedTopology(profile, request, row.pp, row.ep)
    preds = [
        p
        for p in search.candidates(prune=False)
        if p.layout.micro_seqs == micro
        and p.layout.recompute == row.recompute
        and p.layout.gemm == row.gemm
        and p.layout.ep_path == row.ep_path
        and not p.layout.fold_experts
    ]
    if not preds:
        raise RuntimeError(f"{row.config}: the report's layout is not among the legal layouts")
    fitting = [p for p in preds if p.memory.total <= search.capacity]
    if fitting:
        return min(fitting, key=Prediction.rank_key), True
    return min(preds, key=lambda p: p.memory.total), False


def describe(pred: Prediction, fpt: float, request: Request) -> dict:
    lay = pred.layout
    tflops = fpt * request.global_batch / pred.step_s / request.world / 1e12
    return {
        **dataclasses.asdict(lay),
        "step_s": pred.step_s,
        "compute_s": pred.compute_s,
        "exposed_comm_s": pred.exposed_comm_s,
        "bubble_s": pred.bubble_s,
        "recompute_s": pred.recompute_s,
        "tokens_per_s_per_gpu": pred.tokens_per_s / request.world,
        "tflops_per_gpu": tflops,
        "memory_gib": pred.memory.total / GIB,
        "memory": {k: v / GIB for k, v in dataclasses.asdict(pred.memory).items()},
    }


def plan_text(d: dict) -> str:
    sched = f"{d['schedule']} v{d['virtual_stages']}" if d["pp"] > 1 else "-"
    path = d["ep_path"] if d["ep"] > 1 else "-"
    return (
        f"dp {d['dp']} shard {d['dp_shard']} ep {d['ep']} {path} pp {d['pp']} {sched} "
        f"{d['micro_seqs']}x{d['microbatches']} {d['recompute']} {d['gemm']} {d['overlap']}"
    )


def breakdown(d: dict) -> str:
    ms = {
        k: d[k] * 1e3 for k in ("step_s", "compute_s", "exposed_comm_s", "bubble_s", "recompute_s")
    }
    return (
        f"{ms['step_s']:.0f} = {ms['compute_s']:.0f} + {ms['exposed_comm_s']:.0f} + "
        f"{ms['bubble_s']:.0f} + {ms['recompute_s']:.0f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help=f"comma-separated keys ({', '.join(r.key for r in ROWS)})")
    parser.add_argument("--inter-node-gbps", type=float, help="network GB/s per GPU, one way")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    keys = {r.key for r in ROWS}
    wanted = set(args.rows.split(",")) if args.rows else keys
    if wanted - keys:
        parser.error(f"unknown rows {sorted(wanted - keys)}; known: {', '.join(sorted(keys))}")
    gpu = gpu_spec("b300", inter_node_gbps=args.inter_node_gbps)
    rows = [r for r in ROWS if r.key in wanted]

    profiles: dict[str, ModelProfile] = {}
    models = {}
    print(
        "model          d     h  heads/kv  L dense(width)  E   active B (report)   total B (report)"
        "  useful FLOPs"
    )
    for name in dict.fromkeys(r.model for r in rows):
        spec = MODELS[name]
        start = time.perf_counter()
        profiles[name] = profile = build_profile(spec)
        active, total = param_counts(profile)
        for what, mine, theirs in (
            ("active", active, spec.report_active),
            ("total", total, spec.report_total),
        ):
            if not math.isclose(mine, theirs, rel_tol=0.02):
                raise RuntimeError(f"{name}: {what} {mine:.4g} is not within 2% of {theirs:.4g}")
        fpt = flops_per_token(profile)
        models[name] = {
            **dataclasses.asdict(spec),
            "active": active,
            "total": total,
            "flops_per_token": fpt,
            "capture_s": time.perf_counter() - start,
        }
        print(
            f"{name:<12} {spec.dim:>5} {spec.expert_width:>5} {spec.heads:>3}/{spec.kv_heads:<3} "
            f"{spec.layers:>4} {spec.dense_first}({spec.dense_width:>5}) {spec.experts:>4} "
            f"{active / 1e9:>7.3f} ({spec.report_active / 1e9:.2f}) "
            f"{total / 1e9:>9.2f} ({spec.report_total / 1e9:.2f})  {fpt / 1e9:.1f} GFLOP/token"
        )

    results = []
    print()
    print(
        "config            | GPUs | GBS | report topology dDP/eDP/EP/PP, mb | T50 | "
        "report layout here: TFLOP/s, GiB | chosen plan | step ms = comp + comm + bubble + "
        "recomp | TFLOP/s | tok/s/GPU | GiB"
    )
    for row in rows:
        profile, fpt = profiles[row.model], models[row.model]["flops_per_token"]
        request = Request(row.world, gpu, row.gbs_mi * MI, SEQ)
        start = time.perf_counter()
        search = Search(profile, request)
        try:
            best = search.best(3)
        except NoPlanFitsError as exc:
            print(f"{row.config}: {exc}")
            results.append({"row": dataclasses.asdict(row), "error": str(exc)})
            continue
        theirs, fits = report_layout(profile, request, row)
        # the chosen plan may move the routed experts to MXFP8; the best BF16 plan beside it
        bf16 = min(
            (
                p
                for p in Search(profile, request).candidates()
                if p.layout.gemm == "bf16" and p.memory.total <= search.capacity
            ),
            key=Prediction.rank_key,
        )
        elapsed = time.perf_counter() - start
        chosen = [describe(p, fpt, request) for p in best]
        mine = describe(theirs, fpt, request)
        plain = describe(bf16, fpt, request)
        c = chosen[0]
        topo = f"{row.dense_dp}/{row.expert_dp}/{row.ep}/{row.pp}, {row.rank_micro_tokens // SEQ}"
        fit = "" if fits else " (does not fit)"
        print(
            f"{row.config:<17} | {row.world:>4} | {row.gbs_mi:>2}Mi | {topo} {row.gemm} "
            f"{row.recompute} | {row.report_tflops} | {mine['tflops_per_gpu']:.0f}, "
            f"{mine['memory_gib']:.0f}{fit} | {plan_text(c)} | {breakdown(c)} | "
            f"{c['tflops_per_gpu']:.0f} | {c['tokens_per_s_per_gpu']:.0f} | {c['memory_gib']:.0f}"
        )
        print(f"{'':<17}   report layout: {plan_text(mine)} | {breakdown(mine)}")
        print(
            f"{'':<17}   best bf16: {plan_text(plain)} | {breakdown(plain)} | "
            f"{plain['tflops_per_gpu']:.0f} TFLOP/s | {plain['memory_gib']:.0f} GiB"
        )
        results.append(
            {
                "row": dataclasses.asdict(row),
                "chosen": chosen,
                "best_bf16": {**plain, "plan": plan_text(plain), "breakdown_ms": breakdown(plain)},
                "report_layout": {
                    **mine,
                    "fits": fits,
                    "plan": plan_text(mine),
                    "breakdown_ms": breakdown(mine),
                },
                "evaluated": search.evaluated,
                "search_s": elapsed,
            }
        )
    print(
        f"\nB300: {gpu.memory_bytes / GIB:.1f} GiB, 92% usable; ceilings bf16 "
        f"{gpu.gemm_ceiling('bf16'):.0f} / mxfp8 {gpu.gemm_ceiling('mxfp8'):.0f} TFLOP/s, HBM "
        f"{gpu.ceiling('hbm_gbps'):.0f}, NVLink {gpu.ceiling('nvlink_gbps'):.0f}, network "
        f"{gpu.ceiling('inter_node_gbps'):.0f} GB/s per GPU; mb x m = sequences of {SEQ} per "
        "microbatch x microbatches"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu.name, "seq": SEQ, "models": models, "rows": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
