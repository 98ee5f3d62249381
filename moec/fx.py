"""FX graph utilities the analyses and the passes share; nothing here edits a graph (fake
propagation writes nodes' ``meta["val"]``).

Graphs are the ones :func:`moec.trace` captures: placeholders and ``call_function`` nodes carry
``meta["val"]`` (FakeTensors whose sizes may be SymInts of one ShapeEnv), so sizes are sympy
expressions in the size symbols until evaluated at concrete values::

    order = node_order(gm.graph)                  # {node: position}, to sort nodes
    region = called_graph(node)                   # a recompute region's sub-GraphModule, or None
    env = placeholders_for(sub, external_inputs(nodes))   # start a sub-graph of nodes
    module_path(node)                             # "layers.1.ffn.up", from nn_module_stack
    nbytes(node.meta["val"])                      # 4*s0*s1*128 for f32[s0, s1, 128]
    evaluate(expr, example_sizes(gm))             # that expression at the example's sizes

Layer: imports torch and sympy only (no moec module), so kernels aside every layer may use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator
from typing import Any, NamedTuple

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

# --- graphs ------------------------------------------------------------------------------------


def fake_mode(gm: fx.GraphModule) -> FakeTensorMode:
    """The FakeTensorMode of ``gm``'s placeholders' ``meta["val"]``."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        raise RuntimeError(
            "graph placeholders carry no FakeTensor meta['val']; capture with moec.trace"
        )
    return mode


@contextlib.contextmanager
def symbolic_dispatch(mode: FakeTensorMode | None) -> Iterator[None]:
    """Run ops on fake values of ``mode`` (none: as they come) the way ``torch.export`` traced
    them, through the Python dispatcher: composite ops (``linear`` of a 3-D input, ``matmul``)
    then decompose on symbolic sizes. Without it torch 2.11's C++ ``matmul`` reads the sizes as
    numbers and so specializes the program's batch and sequence sizes (torch 2.13 does not)."""
    with mode if mode is not None else contextlib.nullcontext(), enable_python_dispatcher():
        yield


VALUE_META = ("val", "tensor_meta", "example_value", "from_node")
"""Node metadata that belongs to the capture: fake values (of its fake mode and shape
environment) and Inductor's record of the nodes a node came from (nodes of other graphs). A
stored program leaves them out (:mod:`moec.program_cache`); a copied one shares them
(:meth:`moec.program.Program.copy`)."""


def propagate_fake(gm: fx.GraphModule, *, full: bool = False) -> list[fx.Node]:
    """Make every node's ``meta["val"]`` what fake propagation from the placeholders' computes
    (see symbolic_dispatch); return the nodes it ran, in graph order.

    Incremental: the graph remembers what the last propagation left on each node (its op,
    target and arguments, the ``meta["val"]`` object written, that value's metadata). A
    ``call_function`` node runs again only if it is new, its op, target or arguments changed,
    its ``meta["val"]`` is no longer the object propagation wrote, it calls a sub-graph (whose
    nodes are not tracked), or a node it reads ran and came out with other metadata (sizes,
    strides, dtype, device, layout). Fake propagation is a function of exactly these, so every
    node left alone already holds what a full run would give: the result equals a full
    propagation's, which ``full=True`` forces (placeholders, ``get_attr`` and the output always
    run; they are cheap). A propagation that raises forgets every record, so the next one is
    full and raises again where this one did."""
    records = _propagation_records(gm.graph, reset=full)
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    prop = _IncrementalFakeProp(gm, fake_mode(gm), records)
    try:
        with enable_python_dispatcher():
            prop.propagate_dont_convert_inputs(*inputs)
    except Exception:
        records.clear()  # the nodes after the failure were never checked against these
        raise
    return prop.ran


class _Propagated(NamedTuple):
    """What fake propagation last left on a node (:func:`propagate_fake`)."""

    call: tuple[Any, ...]
    """The node's op and target and its flattened arguments (nodes compared by identity)."""
    val: Any
    """The ``meta["val"]`` object it wrote."""
    metadata: Any
    """That value's metadata (:func:`_metadata`): what the nodes reading it depend on."""


def _propagation_records(graph: fx.Graph, reset: bool) -> dict[fx.Node, _Propagated]:
    """The records of ``graph``'s last propagation, kept on the graph (so they live and die
    with it; a copied or new graph starts without)."""
    if reset or not isinstance(getattr(graph, "_moec_propagated", None), dict):
        graph._moec_propagated = {}  # type: ignore[attr-defined]
    return graph._moec_propagated  # type: ignore[attr-defined]


def _call_of(node: fx.Node) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    return (node.op, node.target, spec, *leaves)


def _same_call(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """The same op, target, argument structure and argument objects (identity: a rebuilt
    argument counts as changed, which only costs a re-run)."""
    return (
        len(a) == len(b)
        and a[1] is b[1]
        and a[2] == b[2]
        and a[0] == b[0]
        and all(x is y for x, y in zip(a[3:], b[3:], strict=True))
    )


def _metadata(val: Any) -> Any:
    """What fake propagation of a node's readers depends on in its value ``val``."""

    def tensor(t: torch.Tensor) -> tuple[Any, ...]:
        return (
            tuple(map(_expr, t.shape)),
            tuple(map(_expr, t.stride())) if t.layout == torch.strided else None,
            _expr(t.storage_offset()) if t.layout == torch.strided else None,
            t.dtype,
            t.device,
            t.layout,
        )

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return tensor(x)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _expr(x)
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
            return x
        return ("object", id(x))  # anything else: equal only to itself

    leaves, spec = pytree.tree_flatten(val)
    return spec, tuple(map(leaf, leaves))


def _expr(x: Any) -> Any:
    """A size or symbolic scalar as a comparable value (a sympy expression for a symbol)."""
    return x.node.expr if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else x


class _IncrementalFakeProp(FakeTensorProp):
    """``FakeTensorProp`` that skips the nodes whose value cannot have changed (see
    :func:`propagate_fake`) and records what it ran."""

    def __init__(
        self, gm: fx.GraphModule, mode: FakeTensorMode, records: dict[fx.Node, _Propagated]
    ):
        super().__init__(gm, mode=mode)
        self.records = records
        self.ran: list[fx.Node] = []
        self.changed: set[fx.Node] = set()
        """Nodes that ran and whose value's metadata differs from their last record."""

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        # a real attribute enters as a fake of its own: an in-place op on it (a batch norm's
        # ``num_batches_tracked += 1``) would otherwise run on the model's tensor
        value = super().get_attr(target, args, kwargs)
        real = isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)
        return self._mode.from_tensor(value, static_shapes=True) if real else value

    def run_node(self, n: fx.Node) -> Any:
        record = self.records.get(n)
        call = _call_of(n)
        if (
            n.op == "call_function"
            and record is not None
            and record.val is n.meta.get("val")
            and _same_call(record.call, call)
            and not any(a in self.changed for a in n.all_input_nodes)
            and called_graph(n) is None
        ):
            return record.val
        result = super().run_node(n)
        val = n.meta.get("val")
        metadata = _metadata(val)
        if record is None or record.metadata != metadata:
            self.changed.add(n)
        self.records[n] = _Propagated(call, val, metadata)
        self.ran.append(n)
        return result


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """The position of every node of ``graph`` (a sort key for graph order)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def called_graph(node: fx.Node) -> fx.GraphModule | None:
    """The sub-GraphModule a ``call_function`` node runs as its first argument (a ``get_attr``
    of its owning module, e.g. a recompute region), else None."""
    first = node.args[0] if node.op == "call_function" and node.args else None
    if not (isinstance(first, fx.Node) and first.op == "get_attr"):
        return None
    sub = node.graph.owning_module
    for part in str(first.target).split("."):
        sub = getattr(sub, part, None)
    return sub if isinstance(sub, fx.GraphModule) else None


def graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the sub-GraphModules it holds (recompute regions): what a pass that rewrites
    inside regions visits, each graph alone."""
    subs = [m for _, m in gm.named_modules() if isinstance(m, fx.GraphModule) and m is not gm]
    return [gm, *subs]


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it reads, directly or not."""
    found, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in found:
                found.add(arg)
                stack.append(arg)
    return found


def external_inputs(nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``nodes`` that they read, in first-read order: the inputs of a
    sub-graph made of ``nodes``."""
    member = set(nodes)
    inputs = (a for n in nodes for a in n.all_input_nodes if a not in member)
    return list(dict.fromkeys(inputs))


def placeholders_for(graph: fx.Graph, inputs: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """A placeholder in ``graph`` for each of ``inputs`` (same name and meta), by input: the
    start of a sub-graph's ``node_copy`` environment."""
    env = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    return env


def parameter_count(module: nn.Module) -> int:
    """Elements of ``module``'s parameters (each shared parameter once)."""
    return sum(p.numel() for p in module.parameters())


# --- module paths ------------------------------------------------------------------------------


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module that ran ``node`` (from ``nn_module_stack``,
    without torch.export's ``L['self'].`` prefix), or "" for a node of no module."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("L__self__.")


def ensure_submodule(root: nn.Module, path: str) -> nn.Module:
    """The submodule of ``root`` at the dotted ``path``, empty modules added where it has none
    (``""``: ``root``): where a graph module's new attribute goes."""
    module = root
    for part in path.split(".") if path else []:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    return module


def under(path: str, prefix: str) -> bool:
    """``path`` is the dotted module path ``prefix`` or one inside it (``layers.1`` holds
    ``layers.1.ffn``, not ``layers.10``)."""
    return path == prefix or path.startswith(prefix + ".")


def owning_path(path: str, prefixes: Container[str]) -> str | None:
    """The member of ``prefixes`` that is ``path`` or its nearest dotted prefix, else None."""
    while path:
        if path in prefixes:
            return path
        path = path.rpartition(".")[0]
    return None


# --- symbolic sizes ----------------------------------------------------------------------------


def sym(size: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(int(size))


def numel(val: torch.Tensor) -> sympy.Expr:
    """Elements of a (fake) tensor as an expression in the size symbols."""
    return sympy.Mul(*(sym(s) for s in val.shape)) if val.dim() else sympy.Integer(1)


def nbytes(val: Any) -> sympy.Expr:
    """Bytes of a tensor, or of every tensor in a tuple/list of them (0 for anything else)."""
    if isinstance(val, torch.Tensor):
        return numel(val) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sympy.Add(*(nbytes(v) for v in val))
    return sympy.Integer(0)


def symbolic_input_dims(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Per tensor placeholder of ``gm``, the dimensions whose size is still a symbol."""
    dims = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            dims[node.name] = tuple(
                d for d, size in enumerate(val.shape) if not sym(size).is_number
            )
    return dims


def example_sizes(gm: fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The value of every size symbol at the example inputs ``gm`` was captured with."""
    shape_env = fake_mode(gm).shape_env
    if shape_env is None:
        return {}
    values = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
    return {s: int(v) for s, v in values.items()}


def evaluate(expr: Any, values: dict[sympy.Symbol, int]) -> int:
    """``expr`` (an expression in size symbols, or a number) at the symbol ``values``; a
    ValueError names the symbols left without a value."""
    result = sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in values.items()})
    if result.free_symbols:
        missing = sorted(map(str, result.free_symbols))
        raise ValueError(f"cannot evaluate {expr}: no value for {missing}")
    return int(result)


def argument(node: fx.Node, name: str, default: Any = None) -> Any:
    """The value ``node`` (an op call with a schema, e.g. a ``moec::`` op's) passes for its
    argument ``name``, given by position or keyword (``default`` where it passes none)."""
    names = [a.name for a in node.target._schema.arguments]
    at = names.index(name)
    return node.args[at] if len(node.args) > at else node.kwargs.get(name, default)
