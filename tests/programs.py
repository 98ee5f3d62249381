"""Programs compared field by field: what two builds of one program must agree on."""

from __future__ import annotations

import dataclasses

from moec import program_cache
from moec.fx import VALUE_META
from moec.program import Program


def nodes(program: Program) -> list[tuple]:
    """Each node as the passes left it: name, op, target, arguments, value and metadata."""
    return [
        (
            n.name,
            n.op,
            str(n.target),
            str((n.args, n.kwargs)),
            program_cache._value_text(n.meta.get("val")),
            sorted((k, repr(v)) for k, v in n.meta.items() if k not in VALUE_META),
        )
        for n in program.graph.graph.nodes
    ]


def fields(program: Program) -> dict[str, str]:
    """The program's fields but its graph and pass results, as text."""
    skip = ("graph", "pass_results")
    return {
        f.name: repr(getattr(program, f.name))
        for f in dataclasses.fields(program)
        if f.name not in skip
    }


def tensors(named) -> list[tuple]:
    """Each (name, tensor) as its name, shape, strides and dtype, and the first name of the
    tensor (tied weights: one tensor under two names)."""
    first: dict[int, str] = {}
    return [(n, t.shape, t.stride(), t.dtype, first.setdefault(id(t), n)) for n, t in named]


def state(program: Program) -> list[list[tuple]]:
    """:func:`tensors` of the program's parameters and of its buffers, every name of each."""
    gm = program.graph
    return [
        tensors(gm.named_parameters(remove_duplicate=False)),
        tensors(gm.named_buffers(remove_duplicate=False)),
    ]


def assert_same_program(a: Program, b: Program) -> None:
    """``a`` and ``b`` are one program: code, every node, fields, parameters and buffers."""
    assert a.graph.code == b.graph.code
    assert nodes(a) == nodes(b)
    assert fields(a) == fields(b)
    assert state(a) == state(b)
    assert a.graph.meta == b.graph.meta
