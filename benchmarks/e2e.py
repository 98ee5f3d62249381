"""End-to-end training step: a dense model compiled by moec vs the same MoE written by hand.

The report's profiling workload (Table 47): 8 blocks, the first 2 dense, 32 routed experts
top-8 with SwiGLU width 1536 and one shared expert, d = 1536, sequence 8192, 3 sequences per
microbatch, softmax top-k with normalized weights, capacity factor 1.25. The dense blocks are
wide (24576: the width that gives the report's 2.01B total / 0.995B active parameters with a
100k vocabulary).

  moec      the dense Llama (8 blocks, FFN width 24576 x 2 then 1536 x 6) compiled with the
            plan above (random expert init, shared expert = the dense FFN), bf16 autocast over
            fp32 master weights, AdamW, clipping: ``moec.train.Trainer.train_step``
  eager     the same MoE hand-written in eager PyTorch by a careful user: router -> top-k ->
            stable sort of the routes -> gather -> ``torch._grouped_mm`` x 2 -> weighted
            scatter back; dropless; counts by scatter_add (no bincount); same precision policy
  compiled  that model with every block under ``torch.compile`` (Inductor), bf16 autocast over
            fp32 weights, and again with pure bf16 weights: the strongest baseline a careful
            user writes (skip with ``--no-compiled-baselines``)
  float8    (``--baselines compiled-bf16-float8 compiled-fp32-float8``; needs torchao) the
            compiled model, bf16 weights or autocast over fp32 weights, with torchao's float8
            training (recipe ``rowwise_with_gw_hp``: rowwise FP8 forward and d_x GEMMs, bf16
            weight gradients) on the dense blocks' FFN linears, what moec's ``dense_ffn`` scope
            quantizes: the anchors for the ``--fp8`` rows
  --dropless  moec again without the capacity bound: the hand-written MoE's dropless routing.
            moec's rows print the share of routes dropped per step (as training moves the
            router, capacity drops can cut the expert work the default plan does)
  --no-inductor  moec again with ``plan.lowering.inductor: false`` (on CUDA the default plan
            runs the program through Inductor; this row runs its dense ops eagerly)
  --attention B  moec again with ``plan.lowering.attention = B`` (sdpa: torch's order, what
            ``auto`` runs where FA4 does not; cudnn / flash / efficient / math: ``sdpa`` with
            that SDPA backend tried first, a baseline; cudnn is Hopper's FA3-class kernel; fa4:
            FlashAttention 4's CuTe DSL kernels, what ``auto`` runs on Hopper where
            flash-attn-4 is installed); the hand-written baselines then run with torch's choice
            and again with B (fa4: their attention calls it; not again for sdpa); with --fp8,
            the FP8 dense FFNs' plan with B too
  --combine-in-experts  moec again with ``plan.lowering.combine_in_experts`` (each dispatch and
            combine folded into its expert MLP)
  --n-major  moec again with ``plan.lowering.expert_weights: n_major`` (the default plan's
            routed expert weights are k-major)
  --fp8     moec again with ``precision.gemm: fp8_rowwise`` on the dense FFNs, then on the
            dense FFNs and the routed experts
  --chunked-loss  moec and its FP8 dense FFNs row again with the LM-head loss on moec's own
            chunks (logits GEMM, row kernel, two gradient GEMMs) where the default runs it on
            quack's fused scaled-exp GEMMs (``moec.kernels.cute_loss``)
  --no-fused-loss  every moec row with the LM-head loss on moec's own chunks
  --loss-chunks N ...  moec and its FP8 dense FFNs row again with the LM-head loss computed
            at most 2^N logits at a time (compiled for the target with
            ``Target.loss_chunk_elements`` = 2^N)
  --cuda-graph  moec again with ``plan.experimental.cuda_graph`` (the step replayed as one CUDA
            graph). ``--small`` shows the launch-bound end, where the graph matters most

With quack-kernels installed, moec also runs compiled for the same target without it (no CuTe
DSL GEMMs, ``Target.quack`` off), the ratio printed. Both step on the same synthetic batches.
Printed: steady-state step time, tokens/s, useful MFU
(Eq. 95 with the GPU's dense BF16 peak; the same useful FLOPs for both, from moec's cost
model), peak memory and host syncs per step (CUDA sync debug mode over one step).

    python benchmarks/e2e.py [--steps 10] [--small] [--moec-only] [--inductor] [--cuda-graph]
                             [--attention cudnn] [--rows REGEX]
                             [--json out.json]

The last column is each row's step time over moec's (moec's speedup over it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moec.kernels.target import Target
from moec.models import Llama, LlamaConfig
from moec.plan import Plan
from moec.runtime.metrics import bf16_peak_tflops, count_host_syncs, useful_mfu
from moec.train import TrainConfig, Trainer, language_model_loss

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
"""``--attention`` values that order torch's SDPA backends (a baseline, not a plan value): the
chosen one first, then the others in this order."""


def attention_preference(chosen: str) -> contextlib.AbstractContextManager:
    """SDPA backend ``chosen`` first, then the others (anything else: torch's own order)."""
    if chosen not in SDPA_BACKENDS:
        return contextlib.nullcontext()
    first = SDPA_BACKENDS[chosen]
    order = [first, *(b for b in SDPA_BACKENDS.values() if b != first)]
    return sdpa_kernel(order, set_priority=True)


def preferring(chosen: str, step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` run with SDPA backend ``chosen`` first (:func:`attention_preference`)."""

    def run() -> Any:
        with attention_preference(chosen):
            return step()

    return run


def plan_attention(chosen: str) -> str:
    """The plan's ``lowering.attention`` for an ``--attention`` value."""
    return "sdpa" if chosen in SDPA_BACKENDS else chosen


# Every benchmark trains at the hand-written baseline's learning rate. At moec's default (3e-3,
# warming up over 20 steps) the router collapses on synthetic tokens within ten steps: the
# capacity plan then drops most routes and its steps get faster for doing less expert work.
LR = 1e-4
DROP_WARNING = 0.05  # a timed window dropping more routes than this is flagged

FULL = dict(
    dim=1536,
    layers=8,
    dense_first=2,
    dense_width=24576,
    experts=32,
    top_k=8,
    width=1536,
    seq=8192,
    micro=3,
    vocab=100352,
    heads=12,
)
SMALL = dict(
    dim=128,
    layers=4,
    dense_first=1,
    dense_width=512,
    experts=8,
    top_k=2,
    width=128,
    seq=128,
    micro=2,
    vocab=256,
    heads=4,
)


def dense_model(s: dict) -> Llama:
    widths = (s["dense_width"],) * s["dense_first"] + (s["width"],) * (
        s["layers"] - s["dense_first"]
    )
    cfg = LlamaConfig(
        vocab_size=s["vocab"],
        dim=s["dim"],
        n_layers=s["layers"],
        n_heads=s["heads"],
        n_kv_heads=s["heads"],
        ffn_hidden_per_layer=widths,
        max_seq_len=s["seq"],
    )
    return Llama(cfg)


def moe_plan(s: dict, parallel: dict | None = None) -> Plan:
    return Plan.from_dict(
        {
            "parallel": parallel or {},
            "moe": {
                "num_experts": s["experts"],
                "top_k": s["top_k"],
                "init": "random",
                "expert_width": s["width"],
                "shared_expert": True,
                "dense_first": s["dense_first"],
                "capacity_factor": 1.25,
                "gating": "softmax",
                "normalize_weights": True,
            },
            "precision": {"compute_dtype": "bf16"},
        }
    )


class HandMoE(nn.Module):
    """Dropless top-k MoE with a shared expert: sort + torch._grouped_mm, written by hand."""

    def __init__(self, dense_ffn: nn.Module, experts: int, top_k: int, width: int, lbl_coef: float):
        super().__init__()
        dim = dense_ffn.down_proj.out_features
        self.shared = dense_ffn
        self.top_k, self.experts, self.lbl_coef = top_k, experts, lbl_coef
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(experts, dim, 2 * width) * 0.02)
        self.w_down = nn.Parameter(torch.randn(experts, width, dim) * 0.02)
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(self.experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = counts.cumsum(0).to(torch.int32)
        rows = x[order // self.top_k].to(torch.bfloat16)  # norms leave autocast in fp32
        h = torch._grouped_mm(rows, self.w_up.to(rows.dtype), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_down.to(rows.dtype), offs=offsets)
        out = torch.zeros(flat.numel(), shape[-1], dtype=y.dtype, device=x.device)
        out = out.index_copy(0, order, y).view(-1, self.top_k, shape[-1])
        routed = (out * weights.unsqueeze(-1).to(out.dtype)).sum(1)
        share = counts.float() / flat.numel()
        self.aux = self.lbl_coef * self.experts * (share * probs.mean(0)).sum()
        return (self.shared(x) + routed).view(shape)


def fa4_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FlashAttention 4 called by hand (through moec's op: the kernel a user would call, as a
    custom op ``torch.compile`` traces around)."""
    return torch.ops.moec.flash_attention(q, k, v, True, q.shape[-1] ** -0.5)[0]


def hand_written(s: dict, dense: Llama, attention: str = "auto") -> Llama:
    model = dense
    for block in list(model.layers)[s["dense_first"] :]:
        block.ffn = HandMoE(block.ffn, s["experts"], s["top_k"], s["width"], 0.01)
    if attention == "fa4":
        for block in model.layers:
            block.attn.attend = fa4_causal_attention
    return model


def convert_linears_to_float8(model: nn.Module) -> None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise SystemExit("the float8 baselines need torchao installed") from err
    config = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")

    def dense_ffn(_: nn.Module, fqn: str) -> bool:  # moec's dense_ffn scope: not shared experts
        return ".ffn." in fqn and ".shared." not in fqn and not fqn.endswith("router")

    convert_to_float8_training(model, config=config, module_filter_fn=dense_ffn)


class EagerTrainer:
    """The hand-written MoE's training step. ``compiled``: each block (and the rest of the
    model) under ``torch.compile`` as a careful user would write it; ``bf16_weights``: pure bf16
    parameters (no autocast, bf16 AdamW state) instead of bf16 autocast over fp32 weights;
    ``attention``: the attention backend tried first, as moec's ``lowering.attention``;
    ``float8``: torchao's float8 training on the dense blocks' FFN linears."""

    def __init__(
        self,
        model: Llama,
        s: dict,
        device: torch.device,
        compiled: bool = False,
        bf16_weights: bool = False,
        attention: str = "auto",
        float8: bool = False,
    ):
        self.model, self.device, self.s = model.to(device), device, s
        self.bf16_weights, self.attention = bf16_weights, attention
        if bf16_weights:
            self.model.to(torch.bfloat16)
        if float8:
            convert_linears_to_float8(self.model)
        if compiled:
            for block in self.model.layers:
                block.compile()
        self.moes = [m for m in model.modules() if isinstance(m, HandMoE)]
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cuda")

    def train_step(self) -> torch.Tensor:
        tokens = torch.randint(
            0, self.s["vocab"], (self.s["micro"], self.s["seq"] + 1), device=self.device
        )
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16)
        with contextlib.nullcontext() if self.bf16_weights else autocast:
            with attention_preference(self.attention):
                logits = self.model(tokens[:, :-1])
        loss = language_model_loss(logits, tokens[:, 1:])
        (loss + sum(m.aux for m in self.moes)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _release(device: torch.device) -> None:
    gc.collect()  # a trainer and its step graph refer to each other: free its memory pool now
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(
    step, device: torch.device, warmup: int, drops: Callable[[], float] | None = None
) -> tuple[int | None, list[float], list[float]]:
    """Run ``warmup`` steps, count the host syncs of one more, then drain the device and reset
    its peak-memory counter: the timed window starts clean. Also returns each warm-up step's
    device time in ms (so a run shows whether its warm-up reached the steady state) and, given
    ``drops`` (a program's routed-token drop rate, read from the device), each step's."""
    marks = _StepMarks(device)
    drop_rates = []
    for _ in range(warmup):
        step()
        marks.mark()
        if drops is not None:
            drop_rates.append(drops())
    syncs = count_host_syncs(step, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return syncs, marks.step_ms(), drop_rates


class _StepMarks:
    """CUDA events between steps: per-step device time without a host sync inside the window
    (the events are read once, after it). On the CPU, host time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def measure(
    name: str,
    step,
    device: torch.device,
    steps: int,
    warmup: int,
    flops: float,
    tokens: int,
    drops: Callable[[], float] | None = None,
) -> dict:
    """Mean step time over ``steps`` after ``warmup``; ``drops``: the program's drop rate
    (moec's capacity-bounded routing drops tokens, the hand-written MoE is dropless: a step
    that drops most routes does less expert work, so the rate goes beside the time)."""
    syncs, warmup_ms, warmup_drops = warm_up(step, device, warmup, drops)
    marks = _StepMarks(device)
    start = time.perf_counter()
    losses = []
    for _ in range(steps):
        losses.append(step())
        marks.mark()
    final = float(losses[-1])  # reads the device: the end of the timed window
    seconds = (time.perf_counter() - start) / steps
    step_ms = marks.step_ms()
    peak = bf16_peak_tflops(device)
    trail = " ".join(f"{ms:.0f}" for ms in warmup_ms + step_ms)
    median = f", median {statistics.median(step_ms):.1f} ms" if step_ms else ""
    print(
        f"{name}: {seconds:.4f} s/step{median} (ms per step, warm-up then timed: {trail})",
        flush=True,
    )
    drop_rate = None if drops is None else drops()
    if drops is not None:
        rates = " ".join(f"{100 * r:.0f}" for r in [*warmup_drops, drop_rate])
        print(f"{name}: routes dropped, % (warm-up steps, then the last timed one): {rates}")
        if drop_rate > DROP_WARNING:
            print(
                f"warning: {name} dropped {100 * drop_rate:.0f}% of its routes in the timed "
                "window: it did less expert work than a dropless row of the same model"
            )
    return {
        "name": name,
        "step_s": seconds,
        "warmup_step_ms": warmup_ms,
        "timed_step_ms": step_ms,
        "median_step_ms": statistics.median(step_ms) if step_ms else None,
        "tokens_per_s": tokens / seconds,
        "useful_mfu": useful_mfu(flops, seconds, 1, peak),
        "loss": final,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        # a replayed CUDA graph's activations live in its private pool: reserved, not allocated
        "peak_reserved_gb": (
            torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None
        ),
        "host_syncs_per_step": syncs,
        "warmup_drop_rate": warmup_drops,
        "drop_rate": drop_rate,
    }


def snapshot_step(step: Callable[[], Any], name: str, out_dir: str) -> str:
    """One more step with the CUDA allocator's history recorded; the snapshot written to
    ``out_dir/<name>.pickle`` (load it at pytorch.org/memory_viz: which tensors are alive at
    the peak, and who allocated them). Python frames only, to keep the file small."""
    path = os.path.join(out_dir, re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") + ".pickle")
    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()  # outside the timed window: the snapshot must see the step end
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    print(f"{name}: memory snapshot of one step -> {path}")
    return path


def drop_rate(trainer: Trainer) -> float:
    """The share of routes the program's MoE blocks dropped in the last step (reads the
    device)."""
    layers = trainer.compiled.routing_stats().values()
    return sum(layer["drop_rate"] for layer in layers) / len(layers)


# the hand-written baselines by command-line name: their row label, EagerTrainer's options
BASELINES: dict[str, tuple[str, dict[str, bool]]] = {
    "eager": ("eager sort+grouped_mm", {}),
    "compiled-fp32": ("compiled, fp32 weights", {"compiled": True}),
    "compiled-bf16": ("compiled, bf16 weights", {"compiled": True, "bf16_weights": True}),
    "compiled-bf16-float8": (
        "compiled, bf16 weights, torchao float8",
        {"compiled": True, "bf16_weights": True, "float8": True},
    ),
    "compiled-fp32-float8": (
        "compiled, fp32 weights, torchao float8",
        {"compiled": True, "float8": True},
    ),
}
N_MAJOR = "moec, n-major experts"
WITHOUT_QUACK_TOO = {N_MAJOR}  # variants also measured under the policy without the CuTe DSL
FP8_DENSE = "moec, fp8 rowwise dense FFNs"
LOSS_VARIANTS_TOO = {"moec", FP8_DENSE, f"{FP8_DENSE} + fa4 attention"}
"""The rows --chunked-loss and --loss-chunks run again."""


def wanted(args: argparse.Namespace, row: str) -> bool:
    """Whether row ``row`` is measured (``--rows``: a regular expression the name matches)."""
    return args.rows is None or re.search(args.rows, row) is not None


def also_loss_variants(
    args: argparse.Namespace,
    name: str,
    common: tuple,
    trainer_for: Callable[[Target], Trainer],
    target: Target,
) -> list[dict]:
    """Row ``name`` again (``trainer_for(target)`` makes its trainer compiled for ``target``)
    with its LM-head loss on moec's own chunks instead of quack's fused GEMMs
    (``--chunked-loss``, where the target runs the fused pipeline at all: ``fused_loss`` off),
    and with each chunk bound of ``--loss-chunks`` (``loss_chunk_elements``)."""
    if name not in LOSS_VARIANTS_TOO:
        return []
    variants = []
    if args.chunked_loss and common[0].type == "cuda" and target.quack and target.fused_loss:
        variants.append((f"{name}, chunked loss", {"fused_loss": False}))
    for n in args.loss_chunks:
        variants.append((f"{name}, loss chunks of 2^{n}", {"loss_chunk_elements": 1 << n}))
    rows = []
    for row, changes in variants:
        if wanted(args, row):
            trainer = trainer_for(dataclasses.replace(target, **changes))
            drops = functools.partial(drop_rate, trainer)
            rows.append(measure(row, trainer.train_step, *common, drops=drops))
            del trainer, drops
    return rows


def plan_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """The plan changes asked for beside the default plan: (row name, {section: fields})."""
    variants: list[tuple[str, dict[str, dict[str, Any]]]] = []
    if args.dropless:
        variants.append(("moec, dropless", {"moe": {"capacity_factor": None}}))
    if args.attention:
        attention = {"lowering": {"attention": plan_attention(args.attention)}}
        variants.append((f"moec + {args.attention} attention", attention))
    if args.no_inductor:
        variants.append(("moec without inductor", {"lowering": {"inductor": False}}))
    if args.recompute:
        block = {"recompute": {"policy": "block"}}
        variants.append(("moec, block recompute", block))  # auto: through Inductor
        variants.append(
            ("moec, block recompute, eager", {**block, "lowering": {"inductor": False}})
        )
    if args.fp8:
        fp8 = {"gemm": "fp8_rowwise"}
        for name, scope in (
            (FP8_DENSE, ["dense_ffn"]),
            ("moec, fp8 rowwise dense FFNs + experts", ["dense_ffn", "routed_experts"]),
        ):
            variants.append((name, {"precision": fp8 | {"scope": scope}}))
        if args.attention:
            attention = {"lowering": {"attention": plan_attention(args.attention)}}
            fp8_dense = {"precision": fp8 | {"scope": ["dense_ffn"]}}
            variants.append((f"{FP8_DENSE} + {args.attention} attention", fp8_dense | attention))
    if args.combine_in_experts:
        folded = {"lowering": {"combine_in_experts": True}}
        variants.append(("moec + combine_in_experts", folded))
    if args.n_major:
        variants.append((N_MAJOR, {"lowering": {"expert_weights": "n_major"}}))
    if args.cuda_graph:
        graph = {"experimental": {"cuda_graph": True}}
        variants.append(("moec + cuda graph", graph))
        if args.fp8:
            fp8_graph = {"precision": {"gemm": "fp8_rowwise", "scope": ["dense_ffn"]}} | graph
            variants.append(("moec, fp8 rowwise dense FFNs + cuda graph", fp8_graph))
    return variants


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a CPU-sized smoke run")
    parser.add_argument("--moec-only", action="store_true", help="skip the baselines")
    parser.add_argument(
        "--no-inductor",
        action="store_true",
        help="also moec with plan.lowering.inductor false (on CUDA the default lowers to it)",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="also moec with recompute.policy block, by default (Inductor) and eagerly",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="also moec with precision.gemm fp8_rowwise: the dense FFNs, then with the experts",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also moec with plan.experimental.cuda_graph (with --fp8: the FP8 dense FFNs' "
        "plan too)",
    )
    parser.add_argument(
        "--combine-in-experts",
        action="store_true",
        help="also moec with plan.lowering.combine_in_experts",
    )
    parser.add_argument(
        "--n-major",
        action="store_true",
        help="also moec with plan.lowering.expert_weights n_major (the default is k-major)",
    )
    parser.add_argument(
        "--dropless",
        action="store_true",
        help="also moec without a capacity bound (the hand-written MoE's routing: no drops)",
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "fa4", "cudnn", "flash", "efficient", "math"],
        help="also moec with plan.lowering.attention (the attention backend tried first)",
    )
    parser.add_argument(
        "--chunked-loss",
        action="store_true",
        help="also moec and its FP8 dense FFNs with the LM-head loss on moec's own chunks "
        "(where quack's fused loss GEMMs run)",
    )
    parser.add_argument(
        "--rows",
        metavar="REGEX",
        help="measure only the rows whose name matches (the default plan is still built: "
        "its cost model gives every row's useful FLOPs)",
    )
    parser.add_argument(
        "--no-fused-loss",
        action="store_true",
        help="every moec row with the LM-head loss on moec's own chunks (not quack's fused GEMMs)",
    )
    parser.add_argument(
        "--loss-chunks",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also moec and its FP8 dense FFNs with the LM-head loss at most 2^N logits a chunk",
    )
    parser.add_argument(
        "--no-compiled-baselines",
        action="store_true",
        help="skip the hand-written MoE under torch.compile (fp32 weights + autocast, bf16)",
    )
    parser.add_argument(
        "--baselines",
        nargs="+",
        choices=BASELINES,
        default=list(BASELINES)[:3],
        help="which hand-written baselines run (default: those without float8)",
    )
    parser.add_argument(
        "--memory-snapshot",
        metavar="DIR",
        help="after each moec row, one step with the CUDA allocator's history: DIR/<row>.pickle",
    )
    parser.add_argument("--json", help="write the results here")
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    if args.memory_snapshot and not torch.cuda.is_available():
        parser.error("--memory-snapshot records the CUDA allocator: it needs a GPU")
    run(args)


def run(args: argparse.Namespace) -> None:
    s = SMALL if args.small else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    tokens = s["micro"] * s["seq"]
    cfg = TrainConfig(
        lr=LR,
        steps=args.steps + args.warmup + 1,
        batch_size=s["micro"],
        seq_len=s["seq"],
        device=str(device),
        synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_e2e_"),  # a fresh run directory per run
        plots=False,
    )
    target = Target.detect(device)
    if args.no_fused_loss:
        target = dataclasses.replace(target, fused_loss=False)
    quack = device.type == "cuda" and target.quack
    if device.type == "cuda" and not quack:
        print(
            "note: quack-kernels (moec[cutlass]) is not installed: every moec row runs its "
            "expert GEMMs without the CuTe DSL",
            flush=True,
        )
    without_quack = dataclasses.replace(target, quack=False)

    def trainer_for(plan: Plan, bound: Target) -> Trainer:
        _release(device)
        torch.manual_seed(0)
        return Trainer(dense_model(s), plan, cfg, target=bound)

    trainer = Trainer(dense_model(s), moe_plan(s), cfg, target=target)
    flops = trainer.train_flops_per_token * tokens
    common = (device, args.steps, args.warmup, flops, tokens)
    drops = functools.partial(drop_rate, trainer)
    results = []
    if wanted(args, "moec"):
        results.append(measure("moec", trainer.train_step, *common, drops=drops))
        if args.memory_snapshot:
            snapshot = snapshot_step(trainer.train_step, "moec", args.memory_snapshot)
            results[0]["memory_snapshot"] = snapshot
        results[0]["data_stalls"] = trainer.batches.stalls  # steps that waited for their batch
    variant = functools.partial(trainer_for, moe_plan(s))
    results += also_loss_variants(args, "moec", common, variant, target)
    del trainer, drops
    if quack and wanted(args, "moec without CuTe DSL"):  # the policy before the CuTe DSL
        plain = trainer_for(moe_plan(s), without_quack)
        plain_drops = functools.partial(drop_rate, plain)
        results.append(
            measure("moec without CuTe DSL", plain.train_step, *common, drops=plain_drops)
        )
        if results[0]["name"] == "moec":
            print(f"moec CuTe DSL policy: {results[-1]['step_s'] / results[0]['step_s']:.3f}x")
        del plain, plain_drops
    for name, changes in plan_variants(args):
        if not any(wanted(args, row) for row in (name, f"{name} without CuTe DSL")):
            continue
        _release(device)
        torch.manual_seed(0)
        plan = moe_plan(s)
        for section, fields in changes.items():
            for field, value in fields.items():
                setattr(getattr(plan, section), field, value)
        lowered = Trainer(dense_model(s), plan, cfg, target=target)
        lowered_drops = functools.partial(drop_rate, lowered)
        step = lowered.train_step
        if args.attention in SDPA_BACKENDS and name.endswith(f"{args.attention} attention"):
            step = preferring(args.attention, step)
        if wanted(args, name):
            results.append(measure(name, step, *common, drops=lowered_drops))
            results[-1]["data_stalls"] = lowered.batches.stalls
        if args.memory_snapshot:
            results[-1]["memory_snapshot"] = snapshot_step(step, name, args.memory_snapshot)
        variant = functools.partial(trainer_for, plan)
        results += also_loss_variants(args, name, common, variant, target)
        del lowered, lowered_drops, step
        row = f"{name} without CuTe DSL"
        if name in WITHOUT_QUACK_TOO and quack and wanted(args, row):
            plain = trainer_for(plan, without_quack)
            drops_of = functools.partial(drop_rate, plain)
            results.append(measure(row, plain.train_step, *common, drops=drops_of))
            del plain, drops_of
    chosen = [
        key
        for key, (_, options) in BASELINES.items()
        if key in args.baselines and not (args.no_compiled_baselines and options.get("compiled"))
    ]
    # a careful user picks the same attention: with --attention B each baseline runs with
    # torch's choice (the baseline) and with B
    attentions = ["auto"] + ([args.attention] if args.attention not in (None, "sdpa") else [])
    for key, attention in [(k, a) for k in ([] if args.moec_only else chosen) for a in attentions]:
        name, options = BASELINES[key]
        label = name if attention == "auto" else f"{name}, {attention} attention"
        if not wanted(args, label):
            continue
        _release(device)
        torch.manual_seed(0)
        hand = EagerTrainer(
            hand_written(s, dense_model(s), attention), s, device, **options, attention=attention
        )
        results.append(measure(label, hand.train_step, *common))
        del hand
    for r in results:
        r["moec_speedup"] = r["step_s"] / results[0]["step_s"]
    base = results[-1]["step_s"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"\ne2e training step, {name}, {tokens} tokens/step, "
        f"{flops / tokens / 1e9:.2f} useful GFLOP/token"
    )
    print(
        f"{'':40} {'step s':>8} {'tok/s':>10} {'MFU':>6} {'peak GB':>8} {'syncs':>6} "
        f"{'dropped':>8} {'vs last':>8} {'moec/this':>10}"
    )
    for r in results:
        mfu = "-" if r["useful_mfu"] is None else f"{100 * r['useful_mfu']:.1f}%"
        mem = "-" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.1f}"
        syncs = "-" if r["host_syncs_per_step"] is None else str(r["host_syncs_per_step"])
        dropped = "-" if r.get("drop_rate") is None else f"{100 * r['drop_rate']:.1f}%"
        print(
            f"{r['name']:40} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {mfu:>6} {mem:>8} "
            f"{syncs:>6} {dropped:>8} {base / r['step_s']:7.2f}x {r['moec_speedup']:9.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            cute_dsl = quack
            record = {"device": name, "shape": s, "cute_dsl": cute_dsl, "results": results}
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
