"""The driver: ``moec.compile(model, plan)`` = capture -> passes -> the runtime's ``CompiledModel``.

:func:`build_program` is the compiler proper: it captures the model
(:func:`moec.frontend.capture`) in the mode the program must run in, runs the selected passes
(:mod:`moec.passes.manager`) over the captured :class:`~moec.program.Program` and returns the
final program. :func:`compile` checks the pass selection, then hands the runtime either that
program (example inputs given) or a function that builds it on the first call (with
``init_from``, a program materialized from a dense checkpoint); the runtime
(:mod:`moec.runtime`) only ever receives programs and imports no pass.

Mode: the model is captured in train mode, so its dropouts are in the graph and the runtime can
switch them off for ``eval()``; a model holding batch norm (running statistics have no switch)
is captured in the mode it is in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from moec.frontend import capture
from moec.passes.base import PassContext
from moec.passes.manager import DumpHook, PassManager, pipeline_string, select
from moec.plan import Plan
from moec.program import Program
from moec.runtime.compiled import CompiledModel
from moec.runtime.materialize import Checkpoint, materialize


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
    init_from: Checkpoint | None = None,
    init_device: torch.device | str = "cpu",
    check: Callable[[Program], None] | None = None,
) -> CompiledModel:
    """Compile a dense model into the MoE training program ``plan`` describes.

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
    runs on the final program before it is materialized (see :func:`build_program`).
    """
    plan = Plan.from_dict(plan) if isinstance(plan, dict) else plan or Plan()
    names = select(plan, passes, disable)

    def build(args: tuple, kwargs: dict, training: bool) -> Program:
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
        )

    def initialize(program: Program) -> None:
        # a pipeline rank (PipelineMesh) builds only the parameters of the stages it holds
        materialize(program, init_from, init_device, model, pp_rank=getattr(mesh, "pp_rank", None))

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
) -> Program:
    """Capture ``model(*args, **kwargs)`` and run the passes ``names`` (default: the plan's
    pipeline) over it; ``training`` is the mode the program will first run in.
    ``check(program)`` runs after the passes (e.g. a memory check that refuses a plan before
    anything is allocated: :func:`compile` materializes an ``init_from`` program after it)."""
    mode = training if has_batch_norm(model) else True
    with in_mode(model, mode):
        program = capture(model, args, kwargs)
    names = select(plan) if names is None else names
    ctx = PassContext(plan, program, ep_group=getattr(mesh, "ep_info", None))
    PassManager(names, verify=verify, dump=dump, print_after=print_after).run(program, ctx)
    program.pass_results = ctx.results
    program.pass_pipeline = pipeline_string(plan, names)
    if check is not None:
        check(program)
    return program


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
