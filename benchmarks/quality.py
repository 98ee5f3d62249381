"""Is the MoE moec trains any good? Three experiments on a corpus built by ``moec data build``.

    python -m benchmarks.quality parity  --corpus DIR --out OUT [--scale gpu|cpu] [--seeds 0,1,2]
    python -m benchmarks.quality upcycle --corpus DIR --out OUT [--scale gpu|cpu]
    python -m benchmarks.quality balance --corpus DIR --out OUT [--scale gpu|cpu]

- ``parity``: the same MoE (a Llama whose FFNs become 8 experts, top-2, dropless) trained by
  moec and by an independent implementation written here in plain PyTorch
  (:class:`IndependentMoE`: softmax top-k, normalized weights, a loop over experts, the
  Switch/OLMoE load-balancing loss and the router z-loss), from the same initial weights (moec's
  compiled parameters, copied), on the same batches, with the same optimizer (torch's AdamW,
  one warmup-stable-decay schedule, clipping at 1). Per seed, both eval-loss curves; the
  verdict compares the final gap with the spread across seeds.
- ``upcycle``: a dense model pretrained for ``steps``, then continued for ``steps`` as: dense;
  upcycled (8 experts, top-2, every expert a copy of the FFN); granular upcycling; Drop-
  Upcycling; and the same MoE trained from scratch for the whole ``2 * steps``. Eval loss
  against tokens and against training FLOPs (6 x active parameters + attention, per token).
- ``balance``: the MoE from scratch under each load-balancing method of ``moe.balance``, by
  eval loss and MaxVio (the busiest expert's load over the mean, minus 1, per block).

Every arm runs the same loop (:func:`train_arm`): eval loss over ``eval_batches`` fixed batches
of the corpus' eval split (files training never reads), LM loss only, in eval mode, every
``eval_every`` steps. Results go to OUT/<experiment>.json, a plot OUT/<experiment>.png and a
table on stdout. moec runs eagerly (``lowering.inductor: false``): every arm would compile
its own program, which a 10-minute GPU call cannot afford; Inductor changes rounding, not the
model. On the CPU (``--scale cpu``) the programs compute in float32, on CUDA in bf16 over
float32 weights (autocast for the plain-PyTorch arms).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import moec
from moec.corpus import TokenCorpus, built_corpus
from moec.models import Llama, LlamaConfig
from moec.models.zoo import load_model
from moec.runtime.distributed import parameter_groups
from moec.train import LanguageModelWithLoss, TrainConfig, wsd_schedule
from moec.train.objective import parameter_kinds


@dataclasses.dataclass(frozen=True)
class Scale:
    dim: int
    layers: int
    heads: int
    ffn: int
    seq: int
    batch: int
    steps: int
    eval_every: int
    eval_batches: int
    lr: float
    warmup: int
    experts: int = 8
    top_k: int = 2


SCALES = {
    # ~10 M non-embedding parameters dense, ~35 M as an 8-expert MoE; 8 k tokens a step
    "gpu": Scale(256, 4, 4, 688, 256, 32, 2000, 100, 16, 2e-3, 100),
    # the slow test set's CPU version: a few minutes on 2 cores
    "cpu": Scale(32, 2, 4, 64, 32, 8, 150, 25, 4, 1e-2, 10),
}


# --- the independent implementation ----------------------------------------------------------


class IndependentMoE(nn.Module):
    """A dropless top-k SwiGLU MoE in plain PyTorch, written from the papers, not from moec:
    softmax router scores, the top ``top_k`` experts per token (ties to the lower id), their
    scores renormalized to sum to 1, each expert's tokens through its own two GEMMs (a loop
    over experts), outputs summed with the route weights. ``aux``: ``lbl_coef`` x the
    Switch/OLMoE load-balancing loss (N x sum_e f_e P_e, f_e the share of routes sent to e, P_e
    the mean score of e) plus ``z_coef`` x the router z-loss (mean logsumexp(logits)^2).
    Weights in moec's layout: ``w_up[e]`` (dim, 2 x width) as [gate | up], ``w_down[e]``
    (width, dim)."""

    def __init__(self, router: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, top_k: int):
        super().__init__()
        self.router = nn.Parameter(router.detach().clone())
        self.w_up = nn.Parameter(w_up.detach().clone())
        self.w_down = nn.Parameter(w_down.detach().clone())
        self.top_k = top_k
        self.lbl_coef, self.z_coef = 0.01, 0.001
        self.aux = torch.zeros(())
        self.load = torch.zeros(router.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x, self.router).float()  # (T, N)
        scores = logits.softmax(-1)
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        ids = ranked[:, : self.top_k]  # (T, K)
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.w_up.shape[0]):
            token, slot = torch.where(ids == e)
            if token.numel() == 0:
                continue
            gate, up = (x[token] @ self.w_up[e].to(x.dtype)).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w_down[e].to(x.dtype)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        self.load = torch.zeros_like(scores[0]).scatter_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device)
        )
        share = self.load / ids.numel()
        lbl = scores.shape[-1] * (share * scores.mean(0)).sum()
        z = logits.logsumexp(-1).square().mean()
        self.aux = self.lbl_coef * lbl + self.z_coef * z
        return out.view(shape)


class IndependentModel(nn.Module):
    """The dense Llama with each block's FFN an :class:`IndependentMoE` holding the compiled
    program's expert weights; ``forward(inputs, targets)`` -> the LM loss."""

    def __init__(self, dense: Llama, compiled: moec.CompiledModel, top_k: int):
        super().__init__()
        self.model = copy.deepcopy(dense)
        params = dict(compiled.named_parameters())
        for i, block in enumerate(self.model.layers):
            prefix = f"model.layers.{i}.ffn.moe."
            block.ffn = IndependentMoE(
                params[prefix + "router_weight"],
                params[prefix + "w_up"],
                params[prefix + "w_down"],
                top_k,
            )
        own = dict(self.model.named_parameters())
        for name, value in params.items():
            name = name.removeprefix("model.")
            if name in own:  # the dense parameters: the compiled program's, to the bit
                own[name].data.copy_(value.detach())

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def aux_loss(self) -> torch.Tensor:
        return sum(m.aux for m in self.moes())

    def loads(self) -> list[torch.Tensor]:
        return [m.load for m in self.moes()]

    def moes(self) -> list[IndependentMoE]:
        return [m for m in self.modules() if isinstance(m, IndependentMoE)]


# --- models and plans ------------------------------------------------------------------------


def dense_model(ctx: Context, seed: int) -> nn.Module:
    """The dense model, drawn from ``seed``: ``--model`` (a name or ``file.py:factory``, as
    ``moec train`` takes it, sized to the corpus' vocabulary where it is a named model), else
    the bundled Llama at the scale's size."""
    torch.manual_seed(seed)
    if ctx.model:
        return load_model(ctx.model, ctx.vocab)[0]
    s, vocab = ctx.scale, ctx.vocab
    cfg = LlamaConfig(
        vocab_size=vocab,
        dim=s.dim,
        n_layers=s.layers,
        n_heads=s.heads,
        n_kv_heads=s.heads,
        ffn_hidden=s.ffn,
        max_seq_len=s.seq,
    )
    return Llama(cfg)


def moe_plan(s: Scale, device: torch.device, **moe: Any) -> dict[str, Any]:
    plan = {
        "moe": {
            "num_experts": s.experts,
            "top_k": s.top_k,
            "dense_first": 0,
            "capacity_factor": None,  # dropless: the independent MoE drops nothing either
            # the independent MoE's loss, and what the recorded GPU-scale runs used (before
            # sequence became the default); the balance experiment names its method
            "balance": "microbatch",
            **moe,
        },
        "lowering": {"inductor": False},
    }
    if device.type == "cuda":
        plan["precision"] = {"compute_dtype": "bf16"}
    return plan


class Arm:
    """One model under training: ``loss(inputs, targets)`` (the LM loss), ``aux()`` (the
    router losses to add), ``loads()`` (each MoE block's expert loads of the last step)."""

    def __init__(self, module: nn.Module, device: torch.device, plain: bool):
        self.module, self.device, self.plain = module.to(device), device, plain
        plan = getattr(module, "plan", None)
        self.microbatches = plan.parallel.microbatches if plan is not None else 1
        """Forwards per optimizer step (a moec plan's ``parallel.microbatches``)."""

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.plain and self.device.type == "cuda":  # bf16 math over float32 weights
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self.module(inputs, targets)
        return self.module(inputs, targets)

    def finish_step(self) -> None:
        """After the step's backward: moec's balancing reads the step's loads (MaxVio, the
        ``aux_free`` bias)."""
        if isinstance(self.module, moec.CompiledModel):
            self.module.finish_step()

    def aux(self) -> torch.Tensor | float:
        if isinstance(self.module, moec.CompiledModel):
            return self.module.aux_loss()
        return getattr(self.module, "aux_loss", lambda: 0.0)()

    def loads(self) -> list[torch.Tensor]:
        if isinstance(self.module, moec.CompiledModel):
            stats = self.module.routing_stats()
            return [torch.tensor(v["expert_load"], dtype=torch.float64) for v in stats.values()]
        return [t.detach().double().cpu() for t in getattr(self.module, "loads", list)()]


def moec_arm(dense: Llama, plan: dict, ctx: Context) -> Arm:
    example = torch.zeros(2, ctx.scale.seq, dtype=torch.int64)
    compiled = moec.compile(LanguageModelWithLoss(copy.deepcopy(dense)), plan, (example, example))
    return Arm(compiled, ctx.device, plain=False)


# --- the loop --------------------------------------------------------------------------------


def max_violation(loads: list[torch.Tensor]) -> float:
    """The mean over blocks of MaxVio, max_e load_e / mean load - 1 (0 when balanced)."""
    if not loads:
        return float("nan")
    return statistics.fmean(float(x.max() / x.mean() - 1) for x in loads)


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay on matrices (and the stacked expert weights), none on vectors: one rule for every
    arm, whatever its parameter names."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def evaluate(arm: Arm, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    arm.module.eval()
    with torch.no_grad():
        total = sum(float(arm.loss(x, y)) for x, y in batches)
    arm.module.train()
    return total / len(batches)


def train_arm(name: str, arm: Arm, ctx: Context, steps: int, first_step: int = 0) -> dict[str, Any]:
    """Train ``arm`` for ``steps`` on the training split's batches ``first_step ..``; the curve
    of eval loss (and MaxVio of the training step before each eval point) by step, and the eval
    loss before the first step (an upcycled start's equals the dense model's)."""
    s, device = ctx.scale, arm.device
    groups = param_groups(arm.module, 0.1)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), fused=fused)
    schedule = wsd_schedule(TrainConfig(steps=steps, warmup_steps=s.warmup, lr=s.lr))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    params = [p for g in groups for p in g["params"]]
    curve: dict[str, list] = {"step": [], "eval_loss": [], "max_vio": [], "train_loss": []}
    start_eval_loss = evaluate(arm, ctx.evals)
    started = time.perf_counter()
    for step in range(steps):
        inputs, targets = (t.to(device) for t in ctx.train.batch(first_step + step))
        losses = []
        for x, y in zip(inputs.chunk(arm.microbatches), targets.chunk(arm.microbatches)):
            loss = arm.loss(x, y)
            ((loss + arm.aux()) / arm.microbatches).backward()
            losses.append(loss.detach())
        loss = torch.stack(losses).mean()
        arm.finish_step()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if (step + 1) % s.eval_every == 0 or step + 1 == steps:
            curve["step"].append(step + 1)
            curve["train_loss"].append(float(loss.detach()))
            curve["max_vio"].append(max_violation(arm.loads()))
            curve["eval_loss"].append(evaluate(arm, ctx.evals))
    seconds = time.perf_counter() - started
    print(f"  {name}: eval {curve['eval_loss'][-1]:.4f} after {steps} steps ({seconds:.0f} s)")
    return {
        "name": name,
        "seconds": seconds,
        "flops_per_token": flops_per_token(arm),
        "start_eval_loss": start_eval_loss,
        **curve,
    }


# --- the experiments -------------------------------------------------------------------------
#
# Each experiment is a list of phases, each phase a list of independent jobs (a job: one arm's
# training, a function of the context and its keyword arguments, returning its curve). With
# --jobs N a phase's jobs run in N processes at once: on one GPU small launch-bound programs
# share the device well, so three seeds or four arms take about the wall time of one.


def parity_job(ctx: Context, seed: int, implementation: str) -> dict[str, Any]:
    """One seed's run of moec or of the independent MoE, from the same initial weights (the
    compiled program's, which both build from ``seed``)."""
    dense = dense_model(ctx, seed)
    ours = moec_arm(dense, moe_plan(ctx.scale, ctx.device, init="random", seed=seed), ctx)
    if implementation == "independent":
        ours = Arm(IndependentModel(dense, ours.module, ctx.scale.top_k), ctx.device, plain=True)
    run = train_arm(f"{implementation} seed {seed}", ours, ctx, ctx.steps)
    return {**run, "implementation": implementation, "seed": seed}


def pretrain_job(ctx: Context) -> dict[str, Any]:
    """The dense model the upcycling arms start from, saved to ``ctx.out``."""
    dense = dense_model(ctx, ctx.seeds[0])
    arm = Arm(LanguageModelWithLoss(dense), ctx.device, plain=True)
    run = train_arm("dense pretraining", arm, ctx, ctx.steps)
    torch.save(dense.state_dict(), ctx.out / "dense_pretrained.pt")
    return run


UPCYCLING = {
    "dense continued": None,
    "upcycled": {"init": "upcycle"},
    "granular": {"init": "upcycle", "upcycle_granularity": 2},
    "drop-upcycled": {"init": "drop_upcycle", "drop_upcycle_ratio": 0.5},
}


def continue_job(ctx: Context, name: str) -> dict[str, Any]:
    """The pretrained dense model trained on for ``ctx.steps`` as ``name`` (``UPCYCLING``)."""
    dense = dense_model(ctx, ctx.seeds[0])
    dense.load_state_dict(torch.load(ctx.out / "dense_pretrained.pt", weights_only=True))
    moe = UPCYCLING[name]
    if moe is None:
        arm = Arm(LanguageModelWithLoss(dense), ctx.device, plain=True)
    else:
        arm = moec_arm(dense, moe_plan(ctx.scale, ctx.device, seed=ctx.seeds[0], **moe), ctx)
    return train_arm(name, arm, ctx, ctx.steps, first_step=ctx.steps)


def scratch_job(ctx: Context) -> dict[str, Any]:
    """The same MoE from random weights, for as many tokens as pretraining and continuation."""
    seed = ctx.seeds[0]
    plan = moe_plan(ctx.scale, ctx.device, init="random", seed=seed)
    arm = moec_arm(dense_model(ctx, seed), plan, ctx)
    return train_arm("MoE from scratch", arm, ctx, 2 * ctx.steps)


BALANCING = ("microbatch", "global_batch", "sequence", "aux_free")


def balance_job(ctx: Context, method: str) -> dict[str, Any]:
    """The MoE from scratch, capacity factor 1.25, balanced by ``method`` (``moe.balance``),
    each step's batch in 4 microbatches: the global batch's statistics then differ from one
    microbatch's, as they do over data-parallel ranks."""
    seed = ctx.seeds[0]
    plan = moe_plan(
        ctx.scale, ctx.device, init="random", seed=seed, balance=method, capacity_factor=1.25
    )
    plan["parallel"] = {"microbatches": 4}
    arm = moec_arm(dense_model(ctx, seed), plan, ctx)
    return {**train_arm(method, arm, ctx, ctx.steps), "method": method}


def phases(experiment: str, seeds: list[int]) -> list[list[tuple[str, dict[str, Any]]]]:
    if experiment == "parity":
        impls = ("moec", "independent")
        return [[("parity_job", {"seed": s, "implementation": i}) for s in seeds for i in impls]]
    if experiment == "upcycle":
        rest = [("continue_job", {"name": name}) for name in UPCYCLING]
        return [[("pretrain_job", {}), ("scratch_job", {})], rest]
    return [[("balance_job", {"method": m}) for m in BALANCING]]


def summarize(experiment: str, runs: list[dict[str, Any]], ctx: Context) -> dict[str, Any]:
    if experiment == "parity":
        return {"runs": runs, "verdict": parity_verdict(runs, len(ctx.seeds))}
    if experiment == "upcycle":
        pre = next(r for r in runs if r["name"] == "dense pretraining")
        rest = [r for r in runs if r is not pre]
        add_cost_axes(pre, rest, ctx)
        return {"pretraining": pre, "runs": rest}
    return {"runs": runs}


def parity_verdict(runs: list[dict[str, Any]], seeds: int) -> dict[str, Any]:
    """The final eval losses per implementation, their mean gap (moec - independent, paired by
    seed) and the spread across seeds (the larger population standard deviation of the two).
    They agree when the gap is within twice the spread."""
    final = {
        name: [
            r["eval_loss"][-1]
            for r in sorted(runs, key=lambda r: r["seed"])
            if r["implementation"] == name
        ]
        for name in ("moec", "independent")
    }
    gap = statistics.fmean(a - b for a, b in zip(final["moec"], final["independent"], strict=True))
    spread = max(statistics.pstdev(v) for v in final.values()) if seeds > 1 else 0.0
    return {
        "final_eval_loss": final,
        "mean_gap": gap,
        "seed_spread": spread,
        "agree": abs(gap) <= 2 * spread,
    }


def add_cost_axes(pre: dict[str, Any], runs: list[dict[str, Any]], ctx: Context) -> None:
    """Tokens and training FLOPs at each eval point; a continued arm's include pretraining's."""
    tokens_per_step = ctx.scale.batch * ctx.scale.seq
    for run in [pre, *runs]:
        base = ctx.steps if run["name"] in UPCYCLING else 0
        before = base * tokens_per_step * pre["flops_per_token"]
        run["tokens"] = [(base + k) * tokens_per_step for k in run["step"]]
        run["flops"] = [before + k * tokens_per_step * run["flops_per_token"] for k in run["step"]]


def flops_per_token(arm: Arm) -> float:
    """Training FLOPs per token, 6 x the parameters a token's matmuls read: all but embedding
    tables, the routed experts' at ``top_k / num_experts`` of their count (attention's score
    FLOPs left out: at these sizes under 3% of the total)."""
    module = arm.module
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    experts: set[int] = set()
    share = 1.0
    if isinstance(module, moec.CompiledModel):
        tables = parameter_kinds(module.graph_module)["embeddings"]  # found from the graph
        experts = {id(p) for p in parameter_groups(module)[1]}
        share = module.plan.moe.top_k / module.plan.moe.num_experts
    read = 0.0
    for param in module.parameters():
        if id(param) in tables:
            continue
        read += param.numel() * (share if id(param) in experts else 1.0)
    return 6 * read


# --- running ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    scale: Scale
    device: torch.device
    train: TokenCorpus
    evals: list[tuple[torch.Tensor, torch.Tensor]]
    vocab: int
    steps: int
    seeds: list[int]
    out: Path
    model: str
    """``--model``: empty for the bundled Llama."""


EXPERIMENTS = ("parity", "upcycle", "balance")
JOBS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f for f in (parity_job, pretrain_job, continue_job, scratch_job, balance_job)
}


def run_job(args: argparse.Namespace, job: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A job in this process or a worker's: the context is rebuilt from the arguments."""
    return JOBS[job](context(args), **kwargs)


def run_phases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every phase's jobs; each finished run is also written to OUT/<experiment>.json at once
    (``"partial": true``), so a run cut short by a time limit keeps what it finished."""
    runs: list[dict[str, Any]] = []
    partial = Path(args.out) / f"{args.experiment}.json"

    def keep(run: dict[str, Any]) -> None:
        runs.append(run)
        partial.write_text(json.dumps({"partial": True, "runs": runs}, indent=1))

    for phase in phases(args.experiment, [int(x) for x in args.seeds.split(",")]):
        if args.jobs <= 1:
            for job, kwargs in phase:
                keep(run_job(args, job, kwargs))
            continue
        spawn = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(args.jobs, len(phase)), mp_context=spawn) as pool:
            for done in as_completed([pool.submit(run_job, args, *job) for job in phase]):
                keep(done.result())
    return runs


def context(args: argparse.Namespace) -> Context:
    s = SCALES[args.scale]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    corpus = built_corpus(Path(args.corpus))
    device = torch.device(args.device)
    train = TokenCorpus([corpus.train], s.batch, s.seq, corpus.vocab_size, seed=0)
    held_out = TokenCorpus([corpus.eval], s.batch, s.seq, corpus.vocab_size, seed=1)
    evals = [tuple(t.to(device) for t in held_out.batch(i)) for i in range(s.eval_batches)]
    seeds = [int(x) for x in args.seeds.split(",")]
    steps = args.steps or s.steps
    if args.model and args.experiment == "parity":
        raise SystemExit(
            "parity trains the bundled Llama (the independent MoE mirrors it): no --model"
        )
    vocab = corpus.vocab_size
    return Context(s, device, train, evals, vocab, steps, seeds, Path(args.out), args.model)


def plot(result: dict[str, Any], experiment: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"] + ([result["pretraining"]] if "pretraining" in result else [])
    axes_x = ["tokens", "flops"] if experiment == "upcycle" else ["step"]
    fig, axes = plt.subplots(1, len(axes_x) + 1, figsize=(6 * (len(axes_x) + 1), 4))
    for ax, key in zip(axes, axes_x, strict=False):
        for run in runs:
            ax.plot(run[key], run["eval_loss"], label=run["name"])
        ax.set_xlabel(key if key != "flops" else "training FLOPs")
        ax.set_xscale("log" if key == "flops" else "linear")
        ax.set_ylabel("eval loss")
        ax.legend(fontsize=7)
    for run in result["runs"]:
        axes[-1].plot(run["step"], run["max_vio"], label=run["name"])
    axes[-1].set_xlabel("step")
    axes[-1].set_ylabel("MaxVio (mean over blocks)")
    fig.suptitle(f"moec quality: {experiment}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(result: dict[str, Any]) -> str:
    lines = [
        "| run | final eval loss | best eval loss | final MaxVio | seconds |",
        "|---|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {run['name']} | {run['eval_loss'][-1]:.4f} | {min(run['eval_loss']):.4f} | "
            f"{run['max_vio'][-1]:.3f} | {run['seconds']:.0f} |"
        )
    return "\n".join(lines)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=EXPERIMENTS)
    parser.add_argument("--corpus", required=True, help="a `moec data build` folder")
    parser.add_argument("--out", required=True)
    parser.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    parser.add_argument(
        "--model",
        default="",
        help="upcycle/balance: the dense model as moec train takes it (llama, hf-llama, ..., "
        "file.py:factory); default: the bundled Llama at the scale's size",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=0, help="0: the scale's")
    parser.add_argument("--seeds", default="0,1,2", help="parity's seeds; the others use the first")
    parser.add_argument("--jobs", type=int, default=1, help="a phase's jobs in this many processes")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments().parse_args(argv)
    ctx = context(args)
    out = ctx.out
    result = summarize(args.experiment, run_phases(args), ctx)
    result["setup"] = {
        "experiment": args.experiment,
        "scale": dataclasses.asdict(ctx.scale),
        "steps": ctx.steps,
        "seeds": ctx.seeds,
        "device": torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "corpus": str(args.corpus),
    }
    (out / f"{args.experiment}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.experiment, out / f"{args.experiment}.png")
    print(table(result))
    if "verdict" in result:
        print(json.dumps(result["verdict"]))
    return result


if __name__ == "__main__":
    main()
