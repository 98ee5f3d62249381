"""The plan: what moec should turn a dense model into.

A ``Plan`` is a tree of small dataclasses, one per pass family. Every field is checked when the
plan is built; a bad value raises :class:`PlanError` naming the field (``moe.top_k``), the value
and what would be accepted. Plans round-trip through dicts and YAML::

    plan = Plan.from_dict({"moe": {"num_experts": 32, "top_k": 8}, "parallel": {"ep": 8}})
    Plan.load("plan.yaml"); plan.save("plan.yaml")

Checks that need the model (``moe.dense_first`` against the number of blocks, the expert width
against the FFN width) run when the passes see the graph, with the same error type.

Every option is what a user chooses, or an ``auto`` / ``moec plan auto`` chooses on measured
evidence; options kept for experts without a measured gain live in one ``experimental``
section. A field that was removed (:data:`REMOVED_FIELDS`) is a :class:`PlanError` saying what
to use instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moec.errors import MoecError
from moec.imports import load_object, split_ref

FILE_FIELD = "<file>"
"""The ``field`` of a :class:`PlanError` about the plan file itself (its ``value`` is the path)."""


class PlanError(MoecError, ValueError):
    """An impossible or malformed plan. ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        where = f"plan file {str(value)!r}" if field == FILE_FIELD else f"plan field '{field}'"
        shown = "" if field == FILE_FIELD else f" = {value!r}"
        super().__init__(f"{where}{shown} is invalid: {allowed}")


Gating = Literal["softmax", "sigmoid"]
Init = Literal["upcycle", "drop_upcycle", "split", "random"]
Balance = Literal["microbatch", "global_batch", "sequence", "aux_free"]
EPPath = Literal["auto", "rowwise", "a2a_capacity"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]
GemmPrecision = Literal["bf16", "mxfp8", "fp8_rowwise"]
GemmScope = Literal["routed_experts", "shared_expert", "attn_qkv", "attn_out", "dense_ffn"]
RecomputePolicy = Literal["none", "block", "selective", "budget"]
FFNDropout = Literal["error", "drop"]
Attention = Literal["auto", "sdpa", "fa4"]


@dataclass
class MoEPlan:
    """How FFNs become routed experts (pass ``moe``)."""

    num_experts: int = 8
    """Routed experts N per MoE block."""
    top_k: int = 2
    """Experts chosen per token, 1 <= top_k <= num_experts."""
    expert_width: int | None = None
    """Hidden width of one routed expert. None: the dense width / ``upcycle_granularity`` for
    ``upcycle``/``drop_upcycle``, the dense width for ``random``, dense width / num_experts for
    ``split``; the upcycled inits accept only that width."""
    init: Init = "upcycle"
    """How the routed experts start from the dense FFN (width H):

    - ``upcycle``: Sparse Upcycling (Komatsuzaki et al., ICLR 2023): every expert a copy of the
      dense FFN; with normalized weights the MoE equals the dense FFN at init. With
      ``upcycle_granularity`` G > 1, granular upcycling (He et al. 2024, "Upcycling Large
      Language Models into Mixture of Experts"; Megatron-Core's ``moe_upcycling_granularity``):
      the H hidden units are cut into G slices of H / G, expert e holds slice e mod G, so each
      virtual group of G consecutive experts holds the whole FFN; a group shares one router
      row (the router draws num_experts / G rows), so top-k takes groups whole, and the down
      projections are scaled by G: with normalized weights and top_k a multiple of G the MoE
      equals the dense FFN at init.
    - ``drop_upcycle``: Drop-Upcycling (Nakamura et al., ICLR 2025): ``upcycle`` (granular
      too), then in each expert a seeded ``drop_upcycle_ratio`` of its hidden units, a
      different subset per expert, re-initialised: those units' rows of the up (and gate)
      projections and columns of the down projection are redrawn from normal(mean, std) of
      that dense weight matrix (biases are kept). It gives up the dense function at init for
      experts that diverge sooner; the paper finds it overtakes plain upcycling over longer
      runs.
    - ``split``: granular upcycling at G = num_experts: the hidden units partitioned among the
      experts, the router at zero (one virtual group: every logit ties, each chosen expert
      gets the same weight w0) and the down projections scaled by 1 / w0: with top_k =
      num_experts the MoE equals the dense FFN at init (a single expert is ``upcycle``'s).
    - ``random``: fresh normal init at ``expert_width`` with the dense matrices' std."""
    upcycle_granularity: int = 1
    """G of granular upcycling (see ``init``), for ``upcycle`` and ``drop_upcycle``; 1 is plain
    upcycling. A divisor of ``num_experts`` and (checked against the model) of the dense FFN
    width; 1 for the other inits (``split`` is G = num_experts)."""
    drop_upcycle_ratio: float = 0.5
    """The share r of each expert's hidden units ``drop_upcycle`` re-initialises (r times the
    expert width, rounded to the nearest unit), in [0, 1]; 0.5 is the paper's choice, 0 is
    ``upcycle``, 1 redraws every unit."""
    gating: Gating = "softmax"
    """Score function over router logits before top-k."""
    normalize_weights: bool = True
    """Rescale the top-k scores of a token to sum to one."""
    capacity_factor: float | None = 1.25
    """Per-expert buffer = ceil(capacity_factor * tokens * top_k / num_experts); None = dropless."""
    shared_expert: bool = False
    """Keep the dense FFN as one always-active shared expert beside the routed ones."""
    dense_first: int = 0
    """Leading blocks whose FFN stays dense (the report uses 1 or 2)."""
    lbl_coef: float = 0.01
    """Weight of the load-balancing loss of ``balance`` (0 disables it; not used by
    ``aux_free``, which has none)."""
    balance: Balance = "sequence"
    """How the routers are kept balanced (:mod:`moec.runtime.router_losses` computes it). The
    load-balancing loss (LBL) of a set of tokens is ``N * sum_e f_e * P_e``: ``f_e`` the share of
    their offered routes that go to expert e, ``P_e`` the mean over them of e's normalized score
    (1 when balanced, N/top_k when collapsed); ``lbl_coef`` weighs it.

    - ``microbatch``: the LBL of each microbatch on each rank (Switch/OLMoE's instance-level
      loss, and HF Mixtral's).
    - ``global_batch``: ``f`` from the step's expert loads summed over the data-parallel ranks
      and over the step's microbatches so far (Megatron's ``global_aux_loss``, Qwen's global
      batch): microbatch m of M uses the loads of microbatches 1..m of every rank, so the last
      one uses the whole step's; ``P`` stays this microbatch's on this rank, whose mean over
      ranks (the gradient reduction's) is the global ``P``. One all-reduce of the blocks'
      [blocks, N] loads per microbatch, on the device.
    - ``sequence`` (the default): the LBL of each sequence (dim 0 of the batch), averaged over
      sequences (DeepSeek-V2/V3's sequence-wise loss). Why the default: in the quality
      benchmark on one H200 (``benchmarks/RESULTS.md``, "quality", 6c: capacity factor 1.25,
      1000 steps, one seed) it ended with the lowest eval loss and MaxVio of the four, 0.052
      below ``microbatch`` (2.9x the seed spread the parity runs measured).
    - ``aux_free``: no loss; a per-expert bias (a buffer ``<block>.expert_bias``, not trained)
      is added to the gate scores to choose the top-k experts, while the route weights use the
      unbiased scores, and after each step every rank adds ``bias_update_rate * sign(mean load
      - load_e)`` from the step's loads summed over microbatches and data-parallel ranks
      (DeepSeek-V3).

    ``global_batch`` and ``aux_free`` need ``parallel.pp = 1``. Every method also reports each
    block's MaxVio over the step's global load (``routing_stats()``, the training metrics)."""
    bias_update_rate: float = 1e-3
    """Step of the ``aux_free`` bias update (DeepSeek-V3's gamma; 1e-3 is its value for most of
    its training)."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (0 disables it)."""
    router_init_std: float = 0.02
    """Std of the router's normal init (granular upcycling draws one row per virtual group;
    ``split`` starts the router at zero instead)."""
    seed: int = 0
    """Seed of the expert/router initialisation, so a compile is reproducible."""
    activations: dict[str, str] = field(default_factory=dict)
    """Extra plain activations by name, each ``module.path:function`` or ``file.py:function``
    (see :func:`moec.register_activation`); the ``moe`` pass registers them, then recognises
    FFNs that compute them (and their gated forms ``<name>_glu``) by value. Validation checks
    their form only: the code they name runs when a model is compiled with the plan, never
    when a plan is read, shown or recorded."""
    ffn_dropout: FFNDropout = "error"
    """A dropout with p > 0 on an FFN's hidden activation has no counterpart in the routed
    experts: ``error`` refuses to convert that FFN, ``drop`` converts it without the dropout."""

    @property
    def trained_lbl_coef(self) -> float:
        """The load-balancing loss's weight in the objective: ``lbl_coef``, 0 under
        ``aux_free`` (which has no such loss)."""
        return 0.0 if self.balance == "aux_free" else self.lbl_coef

    def validate(self) -> None:
        _require(self.num_experts >= 1, "moe.num_experts", self.num_experts, "an integer >= 1")
        _require(
            1 <= self.top_k <= self.num_experts,
            "moe.top_k",
            self.top_k,
            f"an integer in [1, num_experts={self.num_experts}]",
        )
        if self.expert_width is not None:
            _require(self.expert_width >= 1, "moe.expert_width", self.expert_width, "None or >= 1")
        if self.capacity_factor is not None:
            _require(
                math.isfinite(self.capacity_factor) and self.capacity_factor > 0,
                "moe.capacity_factor",
                self.capacity_factor,
                "a finite number > 0, or None for dropless routing",
            )
        _require(self.dense_first >= 0, "moe.dense_first", self.dense_first, "an integer >= 0")
        self._validate_upcycling()
        for name in ("lbl_coef", "z_loss_coef", "router_init_std", "bias_update_rate"):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value >= 0, f"moe.{name}", value, "a finite number >= 0"
            )
        for name, ref in self.activations.items():
            try:
                split_ref(ref)  # its form only: a plan that is read runs no code
            except ValueError as exc:
                raise PlanError(f"moe.activations.{name}", ref, _REF_FORMS) from exc

    def _validate_upcycling(self) -> None:
        g, field = self.upcycle_granularity, "moe.upcycle_granularity"
        _require(g >= 1, field, g, "an integer >= 1")
        if self.init in ("upcycle", "drop_upcycle"):
            _require(
                self.num_experts % g == 0,
                field,
                g,
                f"a divisor of moe.num_experts={self.num_experts} (each of the G slices of the "
                "dense FFN is held by num_experts / G experts)",
            )
        else:
            _require(
                g == 1,
                field,
                g,
                f"1 for init={self.init!r}: granularity applies to 'upcycle' and 'drop_upcycle' "
                "('split' is granularity num_experts)",
            )
        r = self.drop_upcycle_ratio
        _require(
            math.isfinite(r) and 0 <= r <= 1, "moe.drop_upcycle_ratio", r, "a number in [0, 1]"
        )


_REF_FORMS = "'module.path:function' or 'file.py:function'"


def activation_function(name: str, ref: str) -> Any:
    """The callable ``moe.activations[name] = ref`` names, loaded (the module imported, the
    file run): only when a model is compiled with the plan (the ``moe`` pass); its value is
    checked on registration."""
    where = f"moe.activations.{name}"
    try:
        fn = load_object(ref)
    except ValueError as exc:
        raise PlanError(where, ref, f"{_REF_FORMS} ({exc})") from exc
    _require(callable(fn), where, ref, f"a callable (it names a {type(fn).__name__})")
    return fn


@dataclass
class ParallelPlan:
    """Data, expert and pipeline parallel degrees (passes ``expert_parallel``, ``pipeline``)."""

    dp: int = 1
    """Data-parallel degree of the dense parameters (world size = dp * pp)."""
    dp_shard: int = 1
    """FSDP2 degree inside ``dp``: 1 replicates the dense parameters on every data-parallel rank
    and all-reduces their gradients (DDP); ``dp`` shards them over all of them (FSDP: each rank
    holds 1/dp of every dense parameter, gradient and optimizer moment; gradients are
    reduce-scattered); a divisor in between is HSDP (``dp / dp_shard`` replicas, each sharded
    over ``dp_shard`` consecutive ranks). Expert parameters are expert-parallel slices."""
    ep: int = 1
    """Expert-parallel degree: each EP rank holds num_experts / ep experts; ep divides dp."""
    ep_path: EPPath = "auto"
    """``rowwise`` (sync-free, symmetric memory, GPU), ``a2a_capacity`` (sync-free, any backend);
    ``auto`` picks rowwise on CUDA, else a2a_capacity. (The synchronized baseline the report
    compares against, ``sync_1d``, is a benchmark's: ``benchmarks/ep.py``.)"""
    pp: int = 1
    """Pipeline-parallel degree."""
    virtual_stages: int = 1
    """Stages per pipeline rank (2 for interleaved and V-shaped schedules)."""
    pp_schedule: Schedule = "1f1b"
    """Pipeline schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, or the zero-bubble ``zbv``
    / ``dualpipev`` (V-shaped, 2 stages per rank, no FSDP). The zero-bubble ones split each
    backward into input and weight passes, which needs a torch that keeps a custom op's
    autograd node alive after the input pass (torch 2.11 does not); where the installed torch
    cannot, compiling the plan raises a PlanError naming this field
    (:func:`moec.analysis.pipeline_schedule.check_schedule_runs`, the one gate)."""
    microbatches: int = 1
    """Microbatches per optimizer step (gradient accumulation, or the pipeline's microbatches)."""
    microbatch_size: int | None = None
    """Sequences per microbatch on each data-parallel rank, where the plan was sized for one
    (``moec plan auto`` writes the size it priced: memory, step time and whether pass
    ``overlap`` can halve the batch depend on it; ``moec plan show --model`` predicts memory at
    it); None: not fixed by the plan (the trainer's batch size / ``microbatches``)."""
    pp_units: Literal["block", "sublayer"] = "sublayer"
    """Where pass ``pipeline`` may cut: between residual blocks only (``block``), or also before
    each block's FFN (``sublayer``: half-block units balance stages an attention's worth finer;
    a recompute region stays whole)."""
    pp_layout: list[int] | None = None
    """Units per stage, ``pp * virtual_stages`` entries in stage order (``moec plan auto`` writes
    the split it priced; ``moec debug`` lists the units); None: the pass balances the stages'
    predicted forward time."""
    overlap: Literal["none", "two_batch"] = "none"
    """``two_batch``: pass ``overlap`` splits each MoE block's dispatch/experts/combine into two
    batch halves (routing stays whole) and interleaves them, so one half's exchange can run
    while the other half computes; ``none`` keeps one chain per block."""

    @property
    def shards_experts(self) -> bool:
        """FSDP also splits each expert slice over the ranks holding it (``dp / ep`` of them)."""
        return self.dp_shard > 1 and self.dp > self.ep

    def validate(self) -> None:
        for name in ("dp", "dp_shard", "ep", "pp", "virtual_stages", "microbatches"):
            value = getattr(self, name)
            _require(value >= 1, f"parallel.{name}", value, "an integer >= 1")
        size = self.microbatch_size
        _require(
            size is None or size >= 1, "parallel.microbatch_size", size, "an integer >= 1 or null"
        )
        _require(
            self.dp % self.ep == 0,
            "parallel.ep",
            self.ep,
            f"a divisor of parallel.dp={self.dp} (EP groups are carved out of data parallel)",
        )
        _require(
            self.dp % self.dp_shard == 0,
            "parallel.dp_shard",
            self.dp_shard,
            f"a divisor of parallel.dp={self.dp} (1: DDP, dp: FSDP, in between: HSDP with "
            "dp / dp_shard replicas)",
        )
        if self.pp_schedule in ("zbv", "dualpipev"):
            _require(
                self.virtual_stages == 2,
                "parallel.virtual_stages",
                self.virtual_stages,
                f"2 for the V-shaped schedule {self.pp_schedule!r}",
            )
        if self.pp_layout is not None:
            stages = self.pp * self.virtual_stages
            _require(
                len(self.pp_layout) == stages and all(n >= 1 for n in self.pp_layout),
                "parallel.pp_layout",
                self.pp_layout,
                f"{stages} unit counts >= 1, one per stage (pp * virtual_stages), or null",
            )
        if self.pp > 1:  # the schedule's shape (pass pipeline checks the model's units)
            if self.pp_schedule == "interleaved_1f1b":
                _require(
                    self.virtual_stages >= 2,
                    "parallel.virtual_stages",
                    self.virtual_stages,
                    "2 or more for interleaved_1f1b",
                )
            if self.pp_schedule in ("gpipe", "1f1b"):
                _require(
                    self.virtual_stages == 1,
                    "parallel.virtual_stages",
                    self.virtual_stages,
                    f"1 for {self.pp_schedule!r}",
                )
            need = 2 * self.pp if self.pp_schedule == "dualpipev" else self.pp
            _require(
                self.microbatches >= need,
                "parallel.microbatches",
                self.microbatches,
                f"at least {need} for {self.pp_schedule!r} with pp={self.pp} so every pipeline "
                "stage has work",
            )


@dataclass
class PrecisionPlan:
    """Compute dtype and which GEMMs run in low precision (pass ``precision``)."""

    compute_dtype: Literal["bf16", "fp32"] = "fp32"
    """Activation/compute dtype; master weights and optimizer state stay fp32."""
    gemm: GemmPrecision = "bf16"
    """GEMM precision for the scoped GEMMs; ``bf16`` leaves them in the compute dtype."""
    scope: list[GemmScope] = field(default_factory=lambda: ["routed_experts"])
    """GEMMs the ``gemm`` precision applies to."""

    def validate(self) -> None:
        _require(
            len(set(self.scope)) == len(self.scope), "precision.scope", self.scope, "no repeats"
        )


@dataclass
class RecomputePlan:
    """Activation recompute placement (pass ``recompute``)."""

    policy: RecomputePolicy = "none"
    """``none``, ``block`` (whole blocks), ``selective`` (elementwise work), ``budget``."""
    budget_bytes: int | None = None
    """Activation bytes per GPU for ``policy: budget``."""

    def validate(self) -> None:
        if self.policy == "budget":
            _require(
                self.budget_bytes is not None and self.budget_bytes > 0,
                "recompute.budget_bytes",
                self.budget_bytes,
                "a positive byte count when recompute.policy is 'budget'",
            )


@dataclass
class LossPlan:
    """The LM head and its loss (pass ``fused_loss``)."""

    fused: bool = True
    """Fuse ``linear -> cross_entropy`` (mean or sum) into ``moec::linear_cross_entropy``: the
    logits never exist whole and the head's gradients are computed in the forward. Set false
    for programs that run the forward without a backward (evaluation)."""

    def validate(self) -> None:
        pass


class _FreeSection:
    """A plan section whose fields are independent: nothing to check across them beyond each
    field's type (``Plan.validate`` checks those)."""

    def validate(self) -> None:
        return None


@dataclass
class LoweringPlan(_FreeSection):
    """How the final program runs (:mod:`moec.runtime.lowering`)."""

    inductor: bool | Literal["auto"] = "auto"
    """Hand the final graph (each pipeline stage's, cut at its blocks as the whole program is)
    to ``torch.compile``'s Inductor, which fuses the dense ops between moec's; the ``moec::``
    ops stay opaque calls. ``auto`` (the default): on for a program that runs on CUDA, where it
    measured faster at small and large shapes and at EP = 2 (benchmarks/RESULTS.md), unless the
    plan shards parameters (FSDP) or pipelines the program (neither measured with Inductor on a
    GPU; ``true`` compiles each stage, cut at its blocks, and under ``zbv``/``dualpipev`` a
    compiled block's backward is one autograd node that their weight pass runs twice), or
    recomputes activations by a policy other than ``block``
    (``selective`` and ``budget`` were not measured with Inductor; ``block`` measured faster at
    the same peak memory once the working copies stayed out of the compiled graph). Off on the
    CPU, where compiling costs more than the fusion saves. Under ``auto`` a graph Inductor fails
    to compile runs eagerly, with a warning; ``true`` raises the error.
    :meth:`Plan.lowers_to_inductor` decides."""
    attention: Attention = "auto"
    """Which kernels run ``scaled_dot_product_attention``. ``fa4``: each attention
    FlashAttention 4 takes (no mask or dropout, bf16 compute) runs on its CuTe DSL kernels
    (package flash-attn-4, in ``moec[cutlass]``; Hopper and Blackwell), the rest on torch's
    SDPA (pass ``bind`` swaps them; refused on a GPU FA4 does not run on). ``sdpa``: torch's
    SDPA in torch's order (cuDNN's FA3-class kernel first on Hopper). ``auto`` (the default):
    ``fa4`` where it measured faster than torch's order in the training step, i.e. on Hopper
    with flash-attn-4 installed (benchmarks/RESULTS.md), else ``sdpa``. (SDPA's own backends
    in another order are a baseline of ``benchmarks/e2e.py --attention``.)"""
    combine_in_experts: bool = False
    """Fold each MoE layer's dispatch and combine into its expert MLP (pass
    ``combine_experts``, ``moec::expert_mlp`` with the combine inside): on the CuTe DSL the up
    projection reads the token rows through the route table, and the backward applies the route
    weights and reduces their gradient in the down projection's dgrad epilogue, reading the
    output gradient's token rows, so neither the dispatched T*K x D buffer nor the experts'
    output rows are kept for backward and their gradient is never written. Off by default:
    time-neutral in the e2e step and slightly slower in the layer on an H200, it saves memory
    (benchmarks/RESULTS.md)."""
    expert_weights: Literal["auto", "n_major", "k_major"] = "auto"
    """Memory layout of the routed experts' ``w_up`` [N, D, U] and ``w_down`` [N, H, D] (the
    logical shapes are the same either way). ``n_major``: the output dim unit-stride.
    ``k_major``: the contraction dim unit-stride, as stacked ``nn.Linear`` weights; the CuTe DSL
    then runs the activation in the up projection's epilogue and the activation backward in
    the down dgrad's, reading ``[gate | up]`` in place, and every weight gradient is written in
    the weight's layout. ``auto``: :meth:`Plan.expert_weights_k_major` decides."""


@dataclass
class ExperimentalPlan(_FreeSection):
    """Options kept for experts. Each works and is tested, but it measured no gain at the shape
    moec is benchmarked on, so neither ``auto`` nor ``moec plan auto`` turns it on; the field
    cites what was measured. An option leaves this section when a measurement lets the planner
    or an ``auto`` choose it, or leaves moec."""

    cuda_graph: bool = False
    """Capture the steady-state training step (forward, backward, clipping, AdamW) as one CUDA
    graph and replay it (:mod:`moec.runtime.step_graph`): the host launches one graph instead of
    every kernel. Needs a CUDA device and one process; elsewhere the trainer says why and runs
    eagerly. Measured on an H200 (benchmarks/RESULTS.md, sessions 9, 22, 24): 9.9x at a small,
    launch-bound shape (4 blocks, d = 128), 1.00x at the full e2e shape, where the host runs
    ahead of the device (``benchmarks/e2e.py --cuda-graph``)."""

    def validate(self) -> None:
        pass


@dataclass
class Plan:
    """What moec builds. ``Plan()`` is a valid default: 8 experts, top-2, upcycled."""

    moe: MoEPlan = field(default_factory=MoEPlan)
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    precision: PrecisionPlan = field(default_factory=PrecisionPlan)
    recompute: RecomputePlan = field(default_factory=RecomputePlan)
    loss: LossPlan = field(default_factory=LossPlan)
    lowering: LoweringPlan = field(default_factory=LoweringPlan)
    experimental: ExperimentalPlan = field(default_factory=ExperimentalPlan)

    def __post_init__(self) -> None:
        self.validate()

    def lowers_to_inductor(self, device_type: str) -> bool:
        """Whether the program, run on a ``device_type`` device, goes through Inductor
        (``lowering.inductor``; ``auto`` as its docstring says)."""
        if self.lowering.inductor != "auto":
            return self.lowering.inductor
        return (
            device_type == "cuda"
            and self.parallel.dp_shard == 1
            and self.parallel.pp == 1
            and self.recompute.policy in ("none", "block")
        )

    def expert_weights_k_major(self) -> bool:
        """Whether the routed experts' weights are k-major (``lowering.expert_weights``). ``auto``
        takes k-major unless FSDP shards the experts (its shards split dim 1, which k-major
        makes strided) or the routed experts' GEMMs run in FP8/MXFP8 (whose quantizers write
        their own layouts, so they gain nothing from it)."""
        if self.lowering.expert_weights != "auto":
            return self.lowering.expert_weights == "k_major"
        low_precision = self.precision.gemm != "bf16" and "routed_experts" in self.precision.scope
        return not (self.parallel.shards_experts or low_precision)

    def validate(self) -> None:
        for section in _SECTIONS:
            value = getattr(self, section)
            if not isinstance(value, _SECTIONS[section]):
                raise PlanError(section, value, f"a {_SECTIONS[section].__name__} or a dict")
            _check_types(value, section)
            value.validate()
        _require(
            not (self.lowering.expert_weights == "k_major" and self.parallel.shards_experts),
            "lowering.expert_weights",
            self.lowering.expert_weights,
            "'n_major' or 'auto' when FSDP shards the experts (parallel.dp_shard = "
            f"{self.parallel.dp_shard} > 1 with dp = {self.parallel.dp} > ep = "
            f"{self.parallel.ep}): the shards split dim 1, which a k-major weight holds strided",
        )
        _require(
            self.parallel.pp == 1 or self.moe.balance in ("microbatch", "sequence"),
            "moe.balance",
            self.moe.balance,
            f"'microbatch' or 'sequence' when parallel.pp = {self.parallel.pp}: the pipeline "
            "runtime does not keep the step's expert loads that global_batch and aux_free need",
        )
        _require(
            self.moe.num_experts % self.parallel.ep == 0,
            "parallel.ep",
            self.parallel.ep,
            f"a divisor of moe.num_experts={self.moe.num_experts}",
        )

    # --- I/O -----------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Plan:
        """The plan ``data`` describes (None: the default plan). A section that is absent or
        None (``moe:`` with nothing after it) is that section's defaults; a section of another
        type (``moe: []``, ``parallel: false``) is a :class:`PlanError` naming it."""
        if data is not None and not isinstance(data, dict):
            raise PlanError("<plan>", data, f"a mapping with sections {', '.join(_SECTIONS)}")
        data = dict(data or {})
        _reject_removed(data)
        _reject_unknown(data, _SECTIONS, "plan")
        sections = {}
        for name, section_cls in _SECTIONS.items():
            raw = data.get(name)
            raw = {} if raw is None else raw
            if not isinstance(raw, dict):
                known = ", ".join(f.name for f in dataclasses.fields(section_cls))
                raise PlanError(
                    name, raw, f"a mapping of its fields ({known}) to values, or nothing"
                )
            known = {f.name for f in dataclasses.fields(section_cls)}
            _reject_unknown(raw, known, name)
            sections[name] = section_cls(**raw)
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan in the YAML file ``path``; a file that cannot be read or is not a YAML
        mapping raises :class:`PlanError` naming it."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise PlanError(
                FILE_FIELD, str(path), f"a UTF-8 YAML text file, not binary ({exc})"
            ) from exc
        except OSError as exc:
            raise PlanError(
                FILE_FIELD, str(path), f"a readable file ({exc.strerror or exc})"
            ) from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            problem = " ".join(str(exc).split())
            raise PlanError(FILE_FIELD, str(path), f"valid YAML ({problem})") from exc
        if data is not None and not isinstance(data, dict):
            raise PlanError(
                FILE_FIELD, str(path), f"a YAML mapping with sections {', '.join(_SECTIONS)}"
            )
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_SECTIONS: dict[str, type] = {
    "moe": MoEPlan,
    "parallel": ParallelPlan,
    "precision": PrecisionPlan,
    "recompute": RecomputePlan,
    "loss": LossPlan,
    "lowering": LoweringPlan,
    "experimental": ExperimentalPlan,
}

REMOVED_FIELDS: dict[str, str] = {
    "moe.routing": "moec routes by the learned router; the random and uniform routings are "
    "benchmark baselines (the moec::route op's routing argument)",
    "lowering.regions": "a graph per block was never measured faster than the whole program; "
    "delete the field",
    "lowering.shared_expert_stream": "the shared expert on a second stream measured 1.01x, "
    "within noise (benchmarks/RESULTS.md); delete the field",
    "lowering.cuda_graph": "it moved to experimental.cuda_graph",
    "lowering.gather_up": "the dispatch folded alone measured 0.98x (benchmarks/RESULTS.md); "
    "lowering.combine_in_experts folds the dispatch and the combine",
}
"""Fields an older moec accepted, and what to use now (:class:`PlanError` on a plan naming
one, so an old plan file is never read as something it did not say)."""

REMOVED_VALUES: dict[tuple[str, Any], str] = {
    ("parallel.ep_path", "sync_1d"): "the synchronized EP baseline is a benchmark's "
    "(benchmarks/ep.py); use 'auto', 'rowwise' or 'a2a_capacity'",
    **{
        ("lowering.attention", order): "SDPA's backends in another order are a baseline of "
        "benchmarks/e2e.py --attention; use 'auto', 'sdpa' or 'fa4'"
        for order in ("cudnn", "flash", "efficient", "math")
    },
}
"""Values an older moec accepted for a field, and what to use now."""


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise PlanError(name, value, allowed)


def _reject_removed(data: dict[str, Any]) -> None:
    """Raise :class:`PlanError` on the first removed field or value ``data`` names."""
    for section, raw in data.items():
        if not isinstance(raw, dict):
            continue
        for key, value in raw.items():
            name = f"{section}.{key}"
            why = REMOVED_FIELDS.get(name)
            if why is None and isinstance(value, str):
                why = REMOVED_VALUES.get((name, value))
            if why is not None:
                raise PlanError(name, value, f"removed from the plan: {why}")


def _reject_unknown(data: dict[str, Any], known: Any, where: str) -> None:
    for key in data:
        if key not in known:
            raise PlanError(
                f"{where}.{key}", data[key], f"a known field of {where}: {sorted(known)}"
            )


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_types(section: Any, prefix: str) -> None:
    hints = _type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        expected = hints[f.name]
        if not _matches(value, expected):
            raise PlanError(f"{prefix}.{f.name}", value, f"a value of type {_describe(expected)}")


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        return isinstance(value, dict) and all(
            _matches(k, key_type) and _matches(v, value_type) for k, v in value.items()
        )
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of ({_describe(typing.get_args(tp)[0])})"
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        return f"mapping of ({_describe(key_type)}) to ({_describe(value_type)})"
    return "None" if tp is type(None) else tp.__name__
