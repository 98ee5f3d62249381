"""The verifier run after every pass: graph lint, fake-tensor propagation, parameter books.

It checks the invariants listed in :mod:`moec.passes.rewrite` and raises
:class:`VerificationError` naming the pass and the node that broke one.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from moec.fx import parameter_count, propagate_fake
from moec.program import GraphSignature, Program


class VerificationError(RuntimeError):
    """A pass broke an invariant: a bug in moec, not in the user's input."""


def verify_graph(
    gm: fx.GraphModule,
    stage: str,
    signature: GraphSignature | None = None,
    expected_params: int | None = None,
    unread: frozenset[str] = frozenset(),
) -> None:
    """Check ``gm`` after ``stage``; ``signature`` (when given) must count its outputs;
    ``unread``: parameters the captured model never read (:func:`unread_parameters`), which
    no node needs to read."""

    def fail(msg: str) -> None:
        raise VerificationError(f"after {stage}: {msg}")

    try:
        gm.graph.lint()
    except Exception as exc:
        fail(f"graph lint failed: {exc}")
    attrs = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    attrs |= {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    read = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            read.add(str(node.target))
            if str(node.target) not in attrs and not _is_attr(gm, str(node.target)):
                fail(f"get_attr {node.name} reads missing attribute {node.target!r}")
        if node.op in ("call_function", "get_attr") and "val" not in node.meta:
            fail(f"node {node.name} ({node.target}) has no meta['val']")
    read_ids = {id(p) for n, p in gm.named_parameters(remove_duplicate=False) if n in read}
    orphans = sorted(
        name for name, p in gm.named_parameters() if id(p) not in read_ids and name not in unread
    )
    if orphans:
        fail(f"parameters no node reads: {orphans[:5]}")
    if expected_params is not None and parameter_count(gm) != expected_params:
        fail(f"parameter count {parameter_count(gm)} != expected {expected_params}")
    outputs = gm.graph.output_node().args[0]
    if signature is not None and len(outputs) != signature.num_user_outputs + len(
        signature.aux_outputs
    ):
        fail(
            f"graph has {len(outputs)} outputs, signature says {signature.num_user_outputs} "
            f"user + {len(signature.aux_outputs)} aux"
        )
    _check_fake_propagation(gm, fail)


def unread_parameters(gm: fx.GraphModule) -> frozenset[str]:
    """The parameters of ``gm`` no node computes with: a captured model's parameters its
    forward never reads (an unused ``nn.Linear``). They stay parameters of the program, as in
    the model (no gradient reaches them), and passes may drop their dead ``get_attr`` nodes."""
    reads = [n for n in gm.graph.find_nodes(op="get_attr") if n.users]
    used = {id(p) for n in reads for p in _parameter_of(gm, n)}
    return frozenset(name for name, p in gm.named_parameters() if id(p) not in used)


def _parameter_of(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """The parameter a ``get_attr`` reads, if it reads one."""
    try:
        return [gm.get_parameter(str(node.target))]
    except AttributeError:  # a buffer, submodule or constant
        return []


def verify_program(program: Program, stage: str) -> None:
    """The program's own invariants (:mod:`moec.program`): what it records about parameters
    and buffers names parameters and buffers its graph has."""
    gm = program.graph
    params = {name for name, _ in gm.named_parameters()}
    buffers = {name for name, _ in gm.named_buffers()}
    for what, names in (("param_roles", program.param_roles), ("provenance", program.provenance)):
        if unknown := sorted(set(names) - params):
            raise VerificationError(f"after {stage}: {what} names no parameter: {unknown[:5]}")
    for buffer, masters in program.working_weights.items():
        if buffer not in buffers or not set(masters) <= params:
            raise VerificationError(
                f"after {stage}: working copy {buffer!r} of {masters} is not a buffer of the "
                "graph holding its parameters' rows"
            )


def _is_attr(gm: fx.GraphModule, target: str) -> bool:
    try:
        obj = gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return True
    except AttributeError:
        return False


def _check_fake_propagation(gm: fx.GraphModule, fail) -> None:
    """Every ``call_function`` node's ``meta["val"]`` agrees (sizes, dtypes) with fake
    propagation. Propagation is incremental (:func:`moec.fx.propagate_fake`): the nodes it
    leaves alone hold the very value it wrote when it last ran them, from inputs of the same
    metadata, so checking the nodes it ran checks them all."""
    stored = {n: n.meta.get("val") for n in gm.graph.nodes}
    try:
        ran = propagate_fake(gm)
    except Exception as exc:
        fail(f"fake-tensor propagation failed: {exc}")
    for node in ran:
        before, after = stored[node], node.meta.get("val")
        if node.op != "call_function" or before is None:
            continue
        if _signature_of(before) != _signature_of(after):
            fail(
                f"node {node.name} ({node.target}) meta['val'] {_signature_of(before)} "
                f"disagrees with propagation {_signature_of(after)}"
            )


def _signature_of(val: object) -> object:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: (tuple(str(s) for s in t.shape), t.dtype), val
    )
