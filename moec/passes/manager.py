"""The pass manager: builds the pass pipeline from the registry, runs it, verifies after each pass.

The pipeline is data. Every pass declares its ordering (``after``), what it needs (``requires``)
and when it applies (see :mod:`moec.passes.base`); :func:`default_pipeline` is every registered
pass whose ``applies(plan)`` holds, in the one order those declarations allow (ties broken by
the order of :data:`PASS_MODULES`). A pipeline string (``"moe{...},expert_parallel{...}"``) is
generated from the passes that will run, and the same string, or a subset of it, can be given
back to run exactly those passes (:func:`parse_pipeline`), as MLIR's ``--pass-pipeline`` does;
options in braces are printed from the plan and, when given back, must match it.

After each pass the manager runs the verifier (graph lint, fake-tensor propagation, parameter
bookkeeping) when asked, and calls the dump hook for the stages selected by ``print_after``.
Propagation is incremental (:func:`moec.fx.propagate_fake`): the check after the capture runs
every node, the check after a pass only the nodes it made or changed and those whose inputs
came out different, which is what a full run would find different.
A pass that turns a symbolic input size into a number (the program then runs, and is priced,
only at the example's size) is named in a warning and in its ``specialized_inputs`` statistic,
and the size joins the signature's ``fixed_sizes`` (a call at another size is refused).
Parameters the captured model never reads stay parameters; no pass is asked to read them.
Analyses cached in the :class:`PassContext` are dropped when a pass reports ``modified``.
"""

from __future__ import annotations

import importlib
import re
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from moec.fx import parameter_count, symbolic_input_dims
from moec.passes.base import REGISTRY, PassContext, PassPipelineError
from moec.passes.verify import (
    VerificationError,
    unread_parameters,
    verify_graph,
    verify_program,
)
from moec.plan import Plan
from moec.program import FixedSize, Program

PASS_MODULES = (
    "moec.passes.moe",
    "moec.passes.expert_parallel",
    "moec.passes.precision",
    "moec.passes.overlap",
    "moec.passes.loss",
    "moec.passes.casts",
    "moec.passes.rope",
    "moec.passes.glu",
    "moec.passes.working_weights",
    "moec.passes.recompute",
    "moec.passes.fsdp",
    "moec.passes.combine_experts",
    "moec.passes.pipeline",
    "moec.passes.bind",
)
"""The modules whose import registers moec's passes; their order breaks ordering ties."""

DumpHook = Callable[[str, Program, dict[str, Any]], None]
"""``hook(stage_name, program, stats)``: called for the captured program and after the passes."""


def registered() -> dict[str, type]:
    """Every pass class by name, in pipeline order."""
    for module in PASS_MODULES:
        importlib.import_module(module)
    by_module = sorted(REGISTRY.items(), key=lambda item: _module_rank(item[1]))
    return {name: REGISTRY[name] for name in _ordered(dict(by_module))}


def _module_rank(cls: type) -> int:
    """Where ``cls``'s module stands in :data:`PASS_MODULES` (passes registered elsewhere,
    e.g. by a user, come after moec's)."""
    module = cls.__module__
    return PASS_MODULES.index(module) if module in PASS_MODULES else len(PASS_MODULES)


def _ordered(passes: dict[str, type]) -> list[str]:
    """A topological order of ``passes`` under their ``after``/``requires`` edges; among the
    passes free to go next, the first in ``passes`` goes first."""
    before = {n: set(c.after) | set(c.requires) for n, c in passes.items()}
    for name, needs in before.items():
        if unknown := needs - set(passes):
            raise PassPipelineError(f"pass {name} is ordered after unknown passes {unknown}")
    order: list[str] = []
    while len(order) < len(passes):
        ready = [n for n in passes if n not in order and before[n] <= set(order)]
        if not ready:
            stuck = [n for n in passes if n not in order]
            raise PassPipelineError(f"the ordering declarations of passes {stuck} form a cycle")
        order.append(ready[0])
    return order


def default_pipeline(plan: Plan) -> list[str]:
    """The names of the passes ``plan`` enables, in pipeline order."""
    return [name for name, cls in registered().items() if cls.applies(plan)]


def pipeline_string(plan: Plan, names: Iterable[str] | None = None) -> str:
    """``name{options},...`` for ``names`` (default: the plan's pipeline)."""
    passes = registered()
    names = default_pipeline(plan) if names is None else list(names)
    parts = []
    for name in names:
        options = passes[name].options(plan)
        parts.append(f"{name}{{{options}}}" if options else name)
    return ",".join(parts)


_ITEM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(text: str, plan: Plan) -> list[str]:
    """The pass names of a pipeline string, checked (see :func:`check_pipeline`); options in
    braces must equal what the plan gives that pass."""
    passes = registered()
    names, pos = [], 0
    text = text.strip()
    while pos < len(text):
        match = _ITEM.match(text, pos)
        if match is None or match.end() == pos:
            raise PassPipelineError(
                f"cannot read the pass pipeline at {text[pos:]!r}: expected "
                "'name' or 'name{options}', separated by commas"
            )
        name, options = match.group(1), match.group(2)
        _known(name, passes)
        if options is not None and options != passes[name].options(plan):
            raise PassPipelineError(
                f"pass {name}: options {{{options}}} differ from the plan's "
                f"{{{passes[name].options(plan)}}}; options come from the plan, change it there"
            )
        names.append(name)
        pos = match.end()
    check_pipeline(names, plan)
    return names


def select(plan: Plan, passes: str | None = None, disable: Iterable[str] = ()) -> list[str]:
    """The passes to run: ``passes`` (a pipeline string) or the plan's default pipeline, less
    the ``disable``d ones; checked."""
    names = parse_pipeline(passes, plan) if passes else default_pipeline(plan)
    known = registered()
    for name in disable:
        _known(name, known)
    names = [n for n in names if n not in set(disable)]
    check_pipeline(names, plan)
    return names


def check_pipeline(names: list[str], plan: Plan) -> None:
    """Each name is a registered pass that applies to ``plan``, at most once, in an order its
    ``after`` declarations allow, with every pass it ``requires`` earlier in the list."""
    passes = registered()
    order = list(passes)
    for i, name in enumerate(names):
        _known(name, passes)
        cls = passes[name]
        if name in names[:i]:
            raise PassPipelineError(f"pass {name} appears twice in the pipeline")
        if not cls.applies(plan):
            raise PassPipelineError(
                f"pass {name} does not apply to this plan ({_why_not(cls)}); drop it from "
                "the pipeline or change the plan"
            )
        missing = [r for r in cls.requires if r not in names[:i]]
        if missing:
            raise PassPipelineError(f"pass {name} requires {missing} to run before it")
        late = [n for n in names[:i] if order.index(n) > order.index(name)]
        if late:
            raise PassPipelineError(
                f"pass {name} must run before {late}: the pipeline order is "
                f"{','.join(n for n in order if n in names)}"
            )


def _known(name: str, passes: dict[str, type]) -> None:
    if name not in passes:
        raise PassPipelineError(f"unknown pass {name!r}; the passes are: {', '.join(passes)}")


def _why_not(cls: type) -> str:
    doc = (cls.applies.__doc__ or "").strip()
    return doc or "its applies(plan) is false"


class PassManager:
    """Runs ``names`` (registered passes) over a program."""

    def __init__(
        self,
        names: list[str],
        *,
        verify: bool = True,
        dump: DumpHook | None = None,
        print_after: Iterable[str] | None = None,
    ):
        passes = registered()
        for name in names:
            _known(name, passes)
        self.names = list(names)
        self.passes = [passes[name]() for name in names]
        self.verify, self.dump = verify, dump
        self.print_after = None if print_after is None else set(print_after)
        if self.print_after is not None:
            for name in self.print_after - {"capture"}:
                _known(name, passes)

    def run(self, program: Program, ctx: PassContext) -> Program:
        gm = program.graph
        unread = unread_parameters(gm)
        if self.verify:
            verify_graph(gm, "capture", program.signature)
        self._dump("capture", program, {})
        symbolic = symbolic_input_dims(gm)
        for p in self.passes:
            before = parameter_count(gm)
            text = str(gm.graph) if self.verify else ""
            start = time.perf_counter()
            result = p.run(gm, ctx)
            result.stats["seconds"] = round(time.perf_counter() - start, 3)
            if self.verify and not result.modified and str(result.gm.graph) != text:
                raise VerificationError(
                    f"after {p.name}: the pass reported modified=False but changed the graph "
                    "(cached analyses would be stale)"
                )
            gm = program.graph = result.gm
            symbolic = _check_sizes_stay_symbolic(p.name, symbolic, program, result.stats)
            if result.modified:
                ctx.invalidate_analyses()
            if self.verify:
                expected = (
                    before
                    + result.stats.get("params_added", 0)
                    - result.stats.get("params_removed", 0)
                )
                verify_graph(gm, p.name, program.signature, expected_params=expected, unread=unread)
                verify_program(program, p.name)
            ctx.results[p.name] = result
            self._dump(p.name, program, result.stats)
        return program

    def _dump(self, stage: str, program: Program, stats: dict[str, Any]) -> None:
        if self.dump is not None and (self.print_after is None or stage in self.print_after):
            self.dump(stage, program, stats)


def _check_sizes_stay_symbolic(
    name: str, symbolic: dict[str, tuple[int, ...]], program: Program, stats: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """The inputs' symbolic dims after pass ``name``; those it made concrete are warned about,
    listed in ``stats["specialized_inputs"]`` and added to the signature's ``fixed_sizes``."""
    gm = program.graph
    now = symbolic_input_dims(gm)
    placeholders = gm.graph.find_nodes(op="placeholder")
    index = {n.name: i for i, n in enumerate(placeholders)}
    vals = {n.name: n.meta.get("val") for n in placeholders}
    fixed = [
        FixedSize(index[input_name], input_name, d, int(vals[input_name].shape[d]), f"pass {name}")
        for input_name, dims in symbolic.items()
        if input_name in now
        for d in dims
        if d not in now[input_name]
    ]
    lost = [f"{f.name}.size({f.dim}) = {f.size}" for f in fixed]
    if lost:
        program.signature.fixed_sizes += fixed
        stats["specialized_inputs"] = lost
        warnings.warn(
            f"moec: pass {name} specialized input sizes ({', '.join(lost)}): the program now "
            "runs, and its cost is counted, at these sizes only",
            stacklevel=3,
        )
    return now
