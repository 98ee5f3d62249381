"""Compiled programs kept across processes: a launch of a plan built before runs no pass.

The passes (:mod:`moec.passes`) are a function of what they are given (the captured program,
the plan, the pass selection, the target and this rank's EP group) and of moec's and torch's
code. :func:`key` digests all of these, the captured program whole: each node's op, target,
arguments, fake value (sizes, strides, dtype), module stack and source lines; the graph's
parameters and buffers; the signature. Two compiles with one key run the same passes on the
same input and build the same program. The key is taken after the capture, which is not
skipped: capturing is the only way to know what the model's code does today, and a key on the
model's code alone goes stale when a function it calls changes. A hit costs the capture, the
load and one fake propagation.

Stored (:func:`store`, in ``programs/`` of moec's cache, :mod:`moec.cache`): the final graph's
nodes with their metadata but not their fake values, its parameters and buffers as meta
tensors (a program is cached only when its graph holds no data: one built on the meta device,
materialized afterwards), the program's other fields, and each pass's statistics and warnings.
:func:`load` rebuilds the graph, gives its inputs the captured program's fake values and
propagates them (:func:`moec.fx.propagate_fake`). Every node's value is then the one the passes
left, since each of those is a propagation's (the verifier makes it so). The passes' warnings
are issued again.

Not cached, built as before (:data:`last_reason` says why):

- a program built without verification (``verify=False``): its values are not all a
  propagation's;
- a pipelined program (its stage programs) or one whose graph calls sub-graphs (recompute
  regions);
- a program whose graph, metadata or fields do not pickle (a class defined inside a function).

A file that does not load is a miss, and is replaced. The files are pickles, as Inductor's cache
entries are: the cache folder is the user's own, as trusted as the code it caches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from moec import cache
from moec.fx import VALUE_META, ensure_submodule, propagate_fake
from moec.passes.base import PassResult
from moec.program import Program

FORMAT = 1
"""The stored form's version: part of every key."""

counters: dict[str, int] = {"hits": 0, "misses": 0, "stored": 0, "not_cached": 0}
"""This process's lookups and stores; ``moec.train.timing`` reports the hits."""
last_reason: str | None = None
"""Why the last program was not cached (None: it was, or none was built)."""


def active_folder() -> Path | None:
    """The folder programs are cached in: ``programs/`` of moec's cache once it is set up
    (:func:`moec.cache.setup`: the trainer, ``moec warmup``), else None (nothing cached)."""
    dirs = cache.active()
    return None if dirs is None else dirs.folder / "programs"


def key(
    captured: Program,
    *,
    plan: Any,
    names: list[str],
    target: Any,
    ep_group: Any,
    verify: bool,
) -> str | None:
    """The digest of everything the passes read (see module), or None where the program
    built from ``captured`` is not cached: a graph holding tensor data or a sub-graph, or
    passes run without verification (whose fake values are then not all a propagation's,
    which a loaded program's are)."""
    gm = captured.graph
    if not verify:
        return _not_cached("built without verification (its values are not all propagated)")
    if _calls_sub_graphs(gm):
        return _not_cached("the captured graph calls sub-graphs")
    digest = hashlib.sha256()
    for part in (
        f"format {FORMAT}",
        f"moec {moec_digest()}",
        f"torch {torch.__version__} {torch.version.git_version}",
        f"python {sys.version}",
        repr(plan),
        repr(names),
        repr(target),
        repr(ep_group),
        _fields_text(captured),
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    for node in gm.graph.nodes:
        if any(isinstance(a, torch.Tensor) for a in pytree.tree_leaves((node.args, node.kwargs))):
            return _not_cached(f"node {node.name} takes a tensor as an argument")
        digest.update(_node_text(node).encode())
    state = _state(gm)
    if state is None:
        return _not_cached("the captured graph holds tensor data (a model not on the meta device)")
    for e in state:
        digest.update(repr((e.path, e.kind, e.same_as, _tensor_text(e.tensor))).encode())
    return digest.hexdigest()


def load(digest: str, captured: Program) -> Program | None:
    """The program stored under ``digest`` (None: none is, or it does not load), its fake
    values propagated from the placeholders of ``captured``, the program the key was made of."""
    folder = active_folder()
    path = None if folder is None else folder / f"{digest}.pkl"
    if path is None or not path.is_file():
        counters["misses"] += 1
        return None
    try:
        program, caught = _rebuild(path.read_bytes(), captured)
    except Exception as exc:  # a torn, foreign or stale file: rebuild, and replace it
        warnings.warn(f"moec: ignoring the cached program {path.name}: {exc}", stacklevel=2)
        counters["misses"] += 1
        return None
    counters["hits"] += 1
    replay(caught)
    return program


def store(digest: str, program: Program, caught: list[Warned]) -> None:
    """Keep ``program`` (just built from the program ``digest`` was made of) under ``digest``
    with the warnings its passes issued; a program that cannot be kept is counted, not an
    error (see module)."""
    folder = active_folder()
    if folder is None:
        return
    try:
        data = _stored(program, caught)
    except _NotStorable as exc:
        _not_cached(str(exc))
        return
    try:
        cache.write_atomic(folder / f"{digest}.pkl", data)
    except OSError as exc:  # a full or read-only cache costs the next launch its passes only
        warnings.warn(f"moec: could not cache the program in {folder}: {exc}", stacklevel=2)
        _not_cached(f"the cache could not be written: {exc}")
        return
    counters["stored"] += 1


class Warned(NamedTuple):
    """A warning a pass issued: what :func:`replay` issues again, from where it came."""

    message: str
    category: type[Warning]
    filename: str
    lineno: int

    @classmethod
    def of(cls, caught: warnings.WarningMessage) -> Warned:
        return cls(str(caught.message), caught.category, caught.filename, caught.lineno)


def replay(caught: list[Warned]) -> None:
    """Issue ``caught`` again, each from where it first came (the filters in force decide)."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@functools.cache
def moec_digest() -> str:
    """A digest of every source file of moec: the passes, and what they import."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# --- describing a graph ------------------------------------------------------------------------


def _node_text(node: fx.Node) -> str:
    meta = sorted((k, repr(v)) for k, v in node.meta.items() if k not in VALUE_META)
    return repr(
        (
            node.name,
            node.op,
            _target_text(node.target),
            fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}"),
            repr(node.type),
            _value_text(node.meta.get("val")),
            meta,
        )
    )


def _target_text(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    return f"{module}.{getattr(target, '__qualname__', None) or target}"


def _value_text(val: Any) -> str:
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return _tensor_text(t)
        return repr(t)

    return repr(pytree.tree_map(one, val))


def _tensor_text(t: torch.Tensor) -> str:
    strided = t.layout == torch.strided
    return repr(
        (
            tuple(map(str, t.shape)),
            tuple(map(str, t.stride())) if strided else None,
            str(t.storage_offset()) if strided else None,
            t.dtype,
            t.device.type,
            t.requires_grad,
        )
    )


def _fields_text(program: Program) -> str:
    """The captured program's fields but its graph (its signature, and what capture set)."""
    fields = {
        f.name: repr(getattr(program, f.name))
        for f in dataclasses.fields(program)
        if f.name not in ("graph", "target", "pass_results")
    }
    return repr(sorted(fields.items()))


def _calls_sub_graphs(gm: fx.GraphModule) -> bool:
    return any(isinstance(m, fx.GraphModule) for m in gm.modules() if m is not gm)


class _StateEntry(NamedTuple):
    path: str
    kind: str
    """``parameter``, ``buffer`` or ``buffer (not persistent)``"""
    requires_grad: bool
    tensor: torch.Tensor
    same_as: str | None
    """The path of the entry before it holding the same tensor (tied weights), else None."""


def _state(gm: fx.GraphModule) -> list[_StateEntry] | None:
    """Every parameter and buffer of ``gm`` under every name it has, as meta tensors; None if
    one holds data or ``gm`` holds a tensor that is neither."""
    entries, first_path = [], {}
    for path, module in gm.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        held = {**module._parameters, **module._buffers}
        if any(isinstance(v, torch.Tensor) and k not in held for k, v in vars(module).items()):
            return None
        for name, tensor in held.items():
            if tensor is None:
                continue
            if name in module._parameters:
                kind = "parameter"
            elif name in module._non_persistent_buffers_set:
                kind = "buffer (not persistent)"
            else:
                kind = "buffer"
            same_as = first_path.setdefault(id(tensor), prefix + name)
            same_as = None if same_as == prefix + name else same_as
            entries.append(_StateEntry(prefix + name, kind, tensor.requires_grad, tensor, same_as))
    if any(e.tensor.device.type != "meta" for e in entries):
        return None
    return entries


def _not_cached(reason: str) -> None:
    global last_reason
    last_reason = reason
    counters["not_cached"] += 1
    return None


# --- storing and rebuilding --------------------------------------------------------------------


class _NotStorable(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node's reference to another, by name, in the stored form (not a tuple: fx's
    ``map_aggregate`` takes it as a leaf)."""

    name: str


def _stored(program: Program, caught: list[Warned]) -> bytes:
    gm = program.graph
    if program.pipeline is not None:
        raise _NotStorable("a pipelined program (its stage programs)")
    if _calls_sub_graphs(gm):
        raise _NotStorable("the program calls sub-graphs (recompute regions)")
    state = _state(gm)
    if state is None:
        raise _NotStorable("the program holds tensor data")
    nodes = [
        (
            n.name,
            n.op,
            n.target,
            fx.node.map_arg(n.args, lambda a: _Ref(a.name)),
            fx.node.map_arg(n.kwargs, lambda a: _Ref(a.name)),
            n.type,
            {k: v for k, v in n.meta.items() if k not in VALUE_META},
        )
        for n in gm.graph.nodes
    ]
    fields = dataclasses.replace(program, graph=None, pass_results={}, target=None)
    results = {name: (r.modified, r.stats) for name, r in program.pass_results.items()}
    entry = {
        "format": FORMAT,
        "class_name": type(gm).__name__,
        "graph_meta": dict(gm.meta),
        "nodes": nodes,
        "state": [e._replace(tensor=_meta_like(e.tensor)) for e in state],
        "fields": fields,
        "results": results,
        "warnings": list(caught),
    }
    buffer = io.BytesIO()
    try:
        _Pickler(buffer).dump(entry)
    except Exception as exc:
        raise _NotStorable(f"the program does not pickle: {exc}") from exc
    return buffer.getvalue()


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class _Pickler(pickle.Pickler):
    """Pickles torch's operators by name (they do not pickle) and refuses graph nodes outside
    the node list (a node in a node's metadata would be a node of another graph)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("packet", obj._qualified_op_name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return ("higher_order", obj.name())
        if isinstance(obj, fx.Node):
            raise _NotStorable(f"node metadata holds a graph node ({obj.name})")
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        kind, *name = pid
        if kind == "op":
            qualified, overload = name
            namespace, op = qualified.split("::")
            return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
        if kind == "packet":
            namespace, op = name[0].split("::")
            return getattr(getattr(torch.ops, namespace), op)
        if kind == "higher_order":
            return getattr(torch.ops.higher_order, name[0])
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def _rebuild(data: bytes, captured: Program) -> tuple[Program, list[Warned]]:
    with warnings.catch_warnings():
        # torch 2.11 rebuilds a pickled TreeSpec (the signature's) through its deprecated
        # LeafSpec and says so on every load: torch's own notice, nothing the user can act on
        warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)
        entry = _Unpickler(io.BytesIO(data)).load()
    if entry.get("format") != FORMAT:
        raise ValueError(f"stored in format {entry.get('format')}, this moec reads {FORMAT}")
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph(), class_name=entry["class_name"])
    gm.meta.update(entry["graph_meta"])
    made: dict[str, torch.Tensor] = {}
    for e in entry["state"]:
        owner_path, _, name = e.path.rpartition(".")
        owner = ensure_submodule(gm, owner_path)
        tensor = made[e.same_as] if e.same_as is not None else e.tensor
        if e.kind == "parameter":
            if e.same_as is None:
                tensor = torch.nn.Parameter(tensor, e.requires_grad)
            owner.register_parameter(name, tensor)
        else:
            owner.register_buffer(name, tensor, persistent=e.kind == "buffer")
        made[e.path] = tensor
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name, op, target, args, kwargs, type_, meta in entry["nodes"]:
        args, kwargs = fx.node.map_aggregate(
            (args, kwargs), lambda a: env[a.name] if isinstance(a, _Ref) else a
        )
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_)
        if node.name != name:
            raise ValueError(f"node {name} came back as {node.name}")
        node.meta.update(meta)
        env[name] = node
    captured_inputs = {n.name: n for n in captured.graph.graph.find_nodes(op="placeholder")}
    for node in graph.find_nodes(op="placeholder"):
        if node.name not in captured_inputs:
            raise ValueError(f"input {node.name} is not an input of the captured program")
        node.meta["val"] = captured_inputs[node.name].meta["val"]
    gm.graph = graph
    gm.recompile()
    propagate_fake(gm, full=True)
    program = dataclasses.replace(entry["fields"], graph=gm, target=captured.target)
    program.pass_results = {
        name: PassResult(gm, modified, stats)
        for name, (modified, stats) in entry["results"].items()
    }
    return program, entry["warnings"]
