"""What a pass is: its result, its context, and the registry the pass manager builds pipelines from.

A pass is a :class:`Pass` subclass registered with :func:`register_pass`. It declares

- ``name``: how pipeline strings and dumps call it;
- ``after``: passes that, when they run, run before it (an ordering constraint only);
- ``requires``: passes that must run before it (it reads what they made);
- ``applies(plan)``: whether the default pipeline of ``plan`` runs it;
- ``options(plan)``: its settings as they appear in the pipeline string (``""`` for none);
- ``declines(plan)``: why it would leave the program of ``plan`` unchanged, where the plan
  alone tells (None: it would not, or only the graph tells); its ``run`` applies the same
  checks, and ``moec plan auto`` calls it to propose no plan a pass turns down;

(the defaults: no ordering, always applies, no options)
- ``run(gm, ctx) -> PassResult``: the rewrite. A pass edits ``gm`` (``ctx.program.graph``) and
  records what the runtime must know in ``ctx.program``; everything else it learned goes into
  its result's ``stats``, nothing into globals or ``gm.meta``.

Passes are constructed without arguments; what they need beyond the plan (this rank's EP
group, the program's target: :attr:`PassContext.target`) is in the context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch.fx as fx

from moec.errors import MoecError
from moec.kernels.target import Target
from moec.plan import Plan
from moec.program import EPGroup, Program


class PassPipelineError(MoecError):
    """A pipeline string or pass selection names an unknown pass or breaks an ordering rule."""


@dataclasses.dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Counters tests assert on (``ffns_replaced``) and ``params_added``/``params_removed``."""


@dataclasses.dataclass
class PassContext:
    plan: Plan
    program: Program | None = None
    """The program being compiled (its ``graph`` is the ``gm`` a pass receives); None when a
    pass is run alone on a bare graph, which passes that record nothing accept."""
    ep_group: EPGroup | None = None
    """This rank's expert-parallel group, when ``plan.parallel.ep > 1``."""
    results: dict[str, PassResult] = dataclasses.field(default_factory=dict)
    """Results of the passes that already ran, by name."""
    _analyses: dict[tuple[Callable[..., Any], int], Any] = dataclasses.field(default_factory=dict)

    @property
    def target(self) -> Target:
        """The :class:`~moec.kernels.target.Target` the program is compiled for: the program's
        (``moec.compile`` records it before any pass runs), else (no program, or a program
        built without one) :meth:`Target.detect` of the CPU. Every pass reads its target here."""
        target = self.program.target if self.program is not None else None
        return target or Target.detect("cpu")

    def analysis(self, compute: Callable[[Any], Any], subject: Any) -> Any:
        """``compute(subject)`` (a graph or the program), cached until a pass reports that it
        modified the graph (the manager checks that report when it verifies)."""
        key = (compute, id(subject))
        if key not in self._analyses:
            self._analyses[key] = compute(subject)
        return self._analyses[key]

    def invalidate_analyses(self) -> None:
        self._analyses.clear()

    def require_program(self, pass_name: str) -> Program:
        if self.program is None:
            raise PassPipelineError(
                f"pass {pass_name} records its result in the program: run it on a captured "
                "program (moec.frontend.capture) through PassContext(plan, program)"
            )
        return self.program


class Pass:
    """Base of every pass: the declarations a pass does not override are these defaults."""

    name: ClassVar[str]
    after: ClassVar[tuple[str, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def applies(plan: Plan) -> bool:
        """always"""
        return True

    @staticmethod
    def options(plan: Plan) -> str:
        return ""

    @staticmethod
    def declines(plan: Plan) -> str | None:
        """never, from the plan alone"""
        return None

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError(f"pass {type(self).__name__} does not define run")


REGISTRY: dict[str, type] = {}
"""Every registered pass class by name, in registration order."""

P = TypeVar("P", bound=type)


def register_pass(cls: P) -> P:
    """Class decorator: add a :class:`Pass` subclass to :data:`REGISTRY` (names are unique)."""
    if not (issubclass(cls, Pass) and isinstance(getattr(cls, "name", None), str)):
        raise TypeError(f"{cls.__name__} is not a Pass subclass with a name (moec.passes.base)")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise TypeError(f"two passes named {cls.name!r}: {REGISTRY[cls.name]} and {cls}")
    REGISTRY[cls.name] = cls
    return cls
