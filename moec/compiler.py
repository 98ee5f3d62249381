"""The driver: ``moec.compile(model, plan)`` = capture -> passes -> the runtime's ``CompiledModel``.

:func:`build_program` is the compiler proper: it captures the model
(:func:`moec.frontend.capture`) in the mode the program must run in, runs the selected passes
(:mod:`moec.passes.manager`) over the captured :class:`~moec.program.Program` and returns the
final program. :func:`compile` checks the pass selection, then hands the runtime either that
program (example inputs given) or a function that builds it on the first call (with
``init_from``, a program materialized from a dense checkpoint); the runtime
(:mod:`moec.runtime`) only ever receives programs and imports no pass.

Checks before allocation: ``check(program)`` (a memory check, say) sees the program built on
the meta device (:func:`meta_program`: the model's parameters and buffers, and the inputs, as
meta tensors of the same shapes and dtypes), so a plan it refuses has allocated nothing the
passes would make (routed experts, working copies) and no parameter of the program; only a
check that passes lets the materialization run. The program is built once: the one checked is
then materialized (:func:`moec.runtime.materialize.materialize`) from the model's own tensors
(:class:`~moec.runtime.materialize.ModuleSource`: the parameters the program keeps unchanged
and the buffers are the model's own objects, as a capture of the model shares them) on its
inputs' device, or, for a model on the meta device, from ``init_from``. A program the meta
build cannot give every value (:func:`single_build_blocker`) is built a second time from the
model's real tensors.

Mode: the model is captured in train mode, so its dropouts are in the graph and the runtime can
switch them off for ``eval()``; a model holding batch norm (running statistics have no switch)
is captured in the mode it is in.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from moec import program_cache
from moec.frontend import capture
from moec.kernels.target import Target
from moec.passes.base import PassContext
from moec.passes.manager import DumpHook, PassManager, pipeline_string, select
from moec.plan import Plan
from moec.program import Program
from moec.runtime.compiled import CompiledModel
from moec.runtime.materialize import DenseSource, ModuleSource, lost_constants, materialize

PHASES = ("target", "capture", "passes", "materialize")
phase_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
"""Seconds this process has spent in each phase of compiling, summed over compiles (the
materialization of a checked program included; ``target``: detecting the machine, which
imports the kernel backends, the CuTe DSL among them); :mod:`moec.train.timing` reads the
differences over a run's start."""


@contextlib.contextmanager
def timed(phase: str) -> Iterator[None]:
    """Add the block's wall time to ``phase_seconds[phase]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phase_seconds[phase] += time.perf_counter() - start


def compile(
    model: nn.Module,
    plan: Plan | dict | None = None,
    example_inputs: tuple | Any = None,
    example_kwargs: dict | None = None,
    *,
    mesh: Any = None,
    dump: DumpHook | None = None,
    verify: bool = True,
    passes: str | None = None,
    disable: Iterable[str] = (),
    print_after: Iterable[str] | None = None,
    init_from: DenseSource | None = None,
    init_device: torch.device | str = "cpu",
    check: Callable[[Program], None] | None = None,
    target: Target | None = None,
) -> CompiledModel:
    """Compile a dense model into the MoE training program ``plan`` describes.

    ``target``: the machine the program is bound for (pass ``bind``: which implementation each
    ``moec::`` node runs); default :meth:`Target.detect` of the example inputs' device (or of
    ``init_device`` when they are on the meta device). Benchmarks and tests pass one to compare
    implementations (e.g. ``dataclasses.replace(Target.detect("cuda"), quack=False)``).

    ``mesh``: the process groups (``moec.runtime.distributed.init_from_env`` or
    ``moec.runtime.pipeline.build_pipeline_mesh``) when the plan is expert or pipeline
    parallel. ``passes`` (a pass-pipeline string), ``disable`` and ``print_after`` select
    passes and dumps (see :func:`moec.passes.manager.select`); ``dump`` is called with the
    graph after capture and after each selected pass.

    ``init_from``: a dense checkpoint of ``model`` (a safetensors directory as
    ``save_pretrained`` writes it, a ``.safetensors`` file, a torch state dict or its file);
    the model may then be built on the meta device: after the passes each parameter of the
    program (this rank's part only) is built on ``init_device`` from the checkpoint through
    its provenance (:func:`moec.runtime.materialize.materialize`), e.g.
    ``moec.compile(meta_model, plan, example, init_from="llama-1b/")``; to train from scratch,
    ``init_from=moec.runtime.materialize.FreshInit(seed=0)`` draws each dense tensor by its
    module's initializer, the same at every layout. ``check(program)``
    runs on the final program built on the meta device, before anything of the program is
    allocated (see the module and :func:`build_program`); an error it raises stops the compile.
    """
    plan = Plan.from_dict(plan) if isinstance(plan, dict) else plan or Plan()
    names = select(plan, passes, disable)

    def build(args: tuple, kwargs: dict, training: bool) -> Program:
        bound = target or default_target(args, kwargs, init_device)
        return build_program(
            model,
            plan,
            args,
            kwargs,
            training=training,
            mesh=mesh,
            names=names,
            dump=dump,
            verify=verify,
            print_after=print_after,
            check=check,
            target=bound,
        )

    def initialize(program: Program) -> None:
        # a pipeline rank (PipelineMesh) builds only the parameters of the stages it holds
        with timed("materialize"):
            pp_rank = getattr(mesh, "pp_rank", None)
            materialize(program, init_from, init_device, model, pp_rank=pp_rank)

    compiled = CompiledModel(
        plan,
        build=build,
        mesh=mesh,
        training=model.training,
        initialize=None if init_from is None else initialize,
    )
    if example_inputs is not None:
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        compiled.capture(args, example_kwargs or {})
    return compiled


def build_program(
    model: nn.Module,
    plan: Plan,
    args: tuple,
    kwargs: dict,
    *,
    training: bool = True,
    mesh: Any = None,
    names: list[str] | None = None,
    dump: DumpHook | None = None,
    verify: bool = True,
    print_after: Iterable[str] | None = None,
    check: Callable[[Program], None] | None = None,
    target: Target | None = None,
) -> Program:
    """Capture ``model(*args, **kwargs)`` and run the passes ``names`` (default: the plan's
    pipeline) over it for ``target`` (default: :func:`default_target`); ``training`` is the
    mode the program will first run in.
    ``check(program)`` (e.g. a memory check) runs on the program built on the meta device,
    before anything of it is allocated: for a model on the meta device the program itself
    (which :func:`compile` materializes only afterwards); for a model holding real tensors the
    program built on a meta copy of it, which is then materialized from the model's tensors
    on the inputs' device (see the module), so the model is captured once."""
    target = target or default_target(args, kwargs)
    how = dict(
        plan=plan,
        training=training,
        mesh=mesh,
        names=names,
        dump=dump,
        verify=verify,
        print_after=print_after,
        target=target,
    )
    if check is None or not holds_storage(model):
        program = _build(model, args, kwargs, **how)
        if check is not None:
            check(program)
        return program
    program = meta_program(model, args=args, kwargs=kwargs, **how)
    check(program)
    if single_build_blocker(program) is not None:  # values the meta build lacks
        return _build(model, args, kwargs, **how)
    with timed("materialize"):
        # every pipeline stage, as a capture of the model holds: a pipeline runtime frees the
        # other ranks' (and with them the model's tensors it shares)
        device = inputs_device(args, kwargs, model)
        materialize(program, ModuleSource(model), device, model, every_stage=True)
    return program


def single_build_blocker(program: Program) -> str | None:
    """Why ``program``, built on the meta device from a copy of a model holding real tensors,
    cannot be materialized from the model's tensors (None: it can, the model is captured
    once): a tensor constant the model's forward made on its inputs' device, whose value the
    meta capture lost (:func:`moec.runtime.materialize.lost_constants`)."""
    lost = lost_constants(program)
    return f"tensor constant {lost[0]} made on the meta device by the forward" if lost else None


def meta_program(
    model: nn.Module,
    plan: Plan,
    args: tuple,
    kwargs: dict,
    *,
    training: bool = True,
    mesh: Any = None,
    names: list[str] | None = None,
    target: Target | None = None,
    dump: DumpHook | None = None,
    verify: bool = False,
    print_after: Iterable[str] | None = None,
) -> Program:
    """The program :func:`build_program` builds for ``model(*args, **kwargs)`` (bound for
    ``target``, default :func:`default_target` of the inputs), built on the meta device (no
    verification unless ``verify``): the same graph, parameters (shapes, dtypes, roles),
    working copies and pipeline stages, with no storage. ``model`` is left as it is (its copy,
    :func:`meta_copy`, is captured) and the inputs are read only for their shapes and dtypes;
    nothing the size of a parameter is allocated, so any plan can be predicted."""
    target = target or default_target(args, kwargs)
    meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, _on_meta, (args, kwargs))
    return _build(
        meta_copy(model),
        meta_args,
        meta_kwargs,
        plan=plan,
        training=training,
        mesh=mesh,
        names=names,
        dump=dump,
        verify=verify,
        print_after=print_after,
        target=target,
    )


def _build(model: nn.Module, args: tuple, kwargs: dict, *, training: bool, **how: Any) -> Program:
    """Capture and passes (:func:`build_program` without its check); ``how``: the arguments
    of :func:`_passes`."""
    return _passes(captured_program(model, args, kwargs, training=training), **how)


def captured_program(model: nn.Module, args: tuple, kwargs: dict, *, training: bool) -> Program:
    """The program ``model(*args, **kwargs)`` captures, as the build captures it (in the mode
    it will first run in where that matters: batch norm): what the passes start from."""
    mode = training if has_batch_norm(model) else True
    with in_mode(model, mode), timed("capture"):
        return capture(model, args, kwargs)


def build_from(
    captured: Program, plan: Plan, *, target: Target, mesh: Any = None, verify: bool = True
) -> Program:
    """The program the passes build for ``plan`` on a copy of ``captured`` (a
    :func:`captured_program`), which stays as it is: one capture serves every plan of a
    model, as the planner prices them."""
    how = dict(dump=None, print_after=None, target=target)
    return _passes(captured.copy(), plan=plan, mesh=mesh, names=None, verify=verify, **how)


def _passes(
    program: Program,
    *,
    plan: Plan,
    mesh: Any,
    names: list[str] | None,
    dump: DumpHook | None,
    verify: bool,
    print_after: Iterable[str] | None,
    target: Target,
) -> Program:
    """The passes ``names`` (default: the plan's) run over the captured ``program``, or the
    program they built from an equal one, from moec's cache (:mod:`moec.program_cache`)."""
    program.target = target
    names = select(plan) if names is None else names
    ep_group = getattr(mesh, "ep_info", None)
    digest = None
    if dump is None and print_after is None and program_cache.active_folder() is not None:
        how = dict(plan=plan, names=names, target=target, ep_group=ep_group, verify=verify)
        digest = program_cache.key(program, **how)
    if digest is not None:
        with timed("passes"):
            cached = program_cache.load(digest, program)
        if cached is not None:
            return cached
    ctx = PassContext(plan, program, ep_group=ep_group)
    with timed("passes"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded, to be replayed below
        PassManager(names, verify=verify, dump=dump, print_after=print_after).run(program, ctx)
    program.pass_results = ctx.results
    program.pass_pipeline = pipeline_string(plan, names)
    issued = [program_cache.Warned.of(w) for w in caught]
    if digest is not None:
        program_cache.store(digest, program, issued)
    program_cache.replay(issued)
    return program


def default_target(args: tuple, kwargs: dict, fallback: torch.device | str = "cpu") -> Target:
    """:meth:`Target.detect` for the device of the first input tensor not on the meta device
    (``fallback`` where there is none)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = next((t.device for t in tensors if t.device.type != "meta"), fallback)
    with timed("target"):
        return Target.detect(device)


def inputs_device(args: tuple, kwargs: dict, model: nn.Module) -> torch.device:
    """Where a program of ``model`` built for these inputs runs: the device of the first input
    tensor not on the meta device, else that of the model's first real tensor."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += [*model.parameters(), *model.buffers()]
    return next(t.device for t in tensors if t.device.type != "meta")


def holds_storage(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is a real tensor (not on the meta device)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return any(t.device.type != "meta" for t in tensors)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes,
    dtypes, strides and ``requires_grad``; ``model`` is not changed. Every module is a shallow
    copy (its other attributes, config objects and plain tensors, are shared with the
    original), a module or tensor held in several places (tied weights) is copied once, and no
    tensor's data is copied."""
    memo: dict[int, Any] = {}

    def tensor(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in memo:
            meta = _on_meta(t)
            memo[id(t)] = (
                nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
            )
        return memo[id(t)]

    def module(m: nn.Module | None) -> nn.Module | None:
        if m is None or id(m) in memo:
            return None if m is None else memo[id(m)]
        clone = memo[id(m)] = copy.copy(m)
        clone._parameters = {k: tensor(v) for k, v in m._parameters.items()}
        clone._buffers = {k: tensor(v) for k, v in m._buffers.items()}
        clone._modules = {k: module(v) for k, v in m._modules.items()}
        return clone

    return module(model)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def has_batch_norm(model: nn.Module) -> bool:
    """Whether ``model`` holds batch or instance norm modules (mode-dependent running stats)."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules())


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    """``model`` (all its submodules) in ``training`` mode; each module's own mode restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield model
    finally:
        for module, mode in modes:
            module.training = mode
