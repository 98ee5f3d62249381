"""Capture a model as a flat, trainable ATen-level ``fx.GraphModule``.

``trace(model, example_inputs)`` runs ``torch.export.export(strict=False)`` with every input
dimension marked ``Dim.AUTO`` (so batch and sequence lengths stay symbolic), takes the exported
program's ``.module()`` (parameters as ``get_attr`` nodes, shared with ``model``) and rewrites its
calling convention to a flat one: ``forward(*flat_inputs) -> tuple(flat_outputs)``.
``capture(...)`` returns it as a :class:`moec.program.Program` whose
:class:`~moec.program.GraphSignature` maps the user's ``(args, kwargs)`` and outputs to and from
that flat form; passes may append extra outputs after the user's.

Sizes: a dimension stays symbolic unless the model's code needs it constant (a Python loop over
the sequence, a weight as wide as it); each size the capture made a number is a
:class:`~moec.program.FixedSize` of the signature, with the place in the model's code that
fixed it (from export's shape environment), and a call at another size is a
:class:`~moec.program.SignatureError` naming it. A fixed batch size, or a fixed size of token
ids, is also named in a warning at capture.

A parameter tied to another (one ``nn.Parameter`` under two names, as a masked-LM head's
``decoder.bias``) is read under one name, the first ``named_parameters()`` gives, so every pass
and the program's records name it the same way.

Every ``call_function`` node is an ATen (or moec) op with a fake ``meta["val"]``: export's region
ops (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``) are inlined with their semantics
made explicit (detached outputs, explicit casts), a region op that cannot be inlined is a
:class:`CaptureError`, and export's ``_assert_tensor_metadata`` dtype checks are dropped so
passes may change dtypes upstream of a ``.to``.

``method="symbolic_trace"`` first runs ``torch.fx.symbolic_trace`` (for plain modules that
should be checked for FX traceability) and exports the result, so the IR is the same.
"""

from __future__ import annotations

import inspect
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim

from moec.errors import MoecError
from moec.fx import fake_mode, module_path, sym, symbolic_dispatch
from moec.program import FixedSize, GraphSignature, Program


class CaptureError(MoecError, RuntimeError):
    """The model could not be captured; the message says why and what to try."""


def trace(
    model: torch.nn.Module, example_inputs: tuple | Any, example_kwargs: dict | None = None, **how
) -> fx.GraphModule:
    """The flat ATen graph of ``model(*example_inputs, **example_kwargs)``; ``how``: the
    keyword options of :func:`capture` (see module)."""
    return capture(model, example_inputs, example_kwargs, **how).graph


def _distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs with every tensor that shares storage with an earlier one cloned.
    ``torch.export`` gives one tensor passed twice (``model(ids, ids)``) a single input of the
    graph, so later calls with two different tensors would read the first for both: a silent
    wrong answer. Distinct example tensors keep every argument its own input."""
    seen: set[int] = set()

    def distinct(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        storage = value.untyped_storage().data_ptr() if value.device.type != "meta" else id(value)
        key = storage or id(value)
        if key in seen:
            return value.clone()
        seen.add(key)
        return value

    return pytree.tree_map(distinct, (args, kwargs))


def capture(
    model: torch.nn.Module,
    example_inputs: tuple | Any,
    example_kwargs: dict | None = None,
    *,
    method: str = "export",
    dynamic: bool = True,
) -> Program:
    """Capture ``model(*example_inputs, **example_kwargs)`` as a program: the flat graph and its
    signature, in the mode ``model`` is in (see module)."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"moec.trace needs an nn.Module, got {type(model).__name__}")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if method == "symbolic_trace":
        try:
            model = fx.symbolic_trace(model)
        except Exception as exc:
            raise CaptureError(
                f"torch.fx.symbolic_trace failed on {type(model).__name__}: {exc}\n"
                "use method='export' (the default), which handles data-dependent Python"
            ) from exc
    elif method != "export":
        raise CaptureError(f"unknown capture method {method!r}; use 'export' or 'symbolic_trace'")
    _check_example_sizes(args, kwargs, dynamic)
    args, kwargs = _distinct_inputs(args, kwargs)
    dynamic_shapes = _auto_dims(model, args, kwargs) if dynamic else None
    try:
        with _without_fake_dispatch_cache():
            program = torch.export.export(
                model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes
            )
    except Exception as exc:
        raise CaptureError(_explain(model, exc, dynamic)) from exc
    gm = program.module()
    in_spec, out_spec = gm._in_spec, gm._out_spec
    _drop_export_wrappers(gm)
    _drop_input_guards(gm)
    _inline_higher_order_ops(gm)
    _drop_metadata_asserts(gm)
    _read_tied_parameters_by_one_name(gm)
    gm.graph._codegen = fx.graph.CodeGen()
    output = gm.graph.output_node()
    flat_outputs = tuple(output.args[0])
    output.args = (flat_outputs,)
    gm.recompile()
    signature = GraphSignature(in_spec, out_spec, len(flat_outputs))
    signature.fixed_sizes = fixed_sizes(gm, model, args, kwargs, dynamic)
    if dynamic:
        _warn_fixed_batch_or_sequence(model, gm, signature.fixed_sizes)
    return Program(gm, signature, captured_training=model.training)


def _without_fake_dispatch_cache() -> Any:
    """Export with FakeTensorMode's dispatch cache off (``TORCH_FAKE_TENSOR_DISPATCH_CACHE=0``
    for this call). The fake mode export creates keeps the setting for its life, so moec's
    fake propagation over the captured graph runs without the cache too. With symbolic sizes,
    torch 2.14 rebuilds every cached view output with ``set_``, whose storage-bounds check
    goes through sympy: on a graph of many sliced views (Qwen3.5's Gated DeltaNet, which
    transformers unrolls into a 63-step loop under export) a cache hit costs more than the
    dispatch it saves, and export and propagation take twice as long with the cache as
    without (``benchmarks/RESULTS.md``, "capture and passes (CPU)"); on Llama-like graphs the
    two are even. The cache changes no value: it only memoizes dispatches."""
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=False)


def _warn_fixed_batch_or_sequence(
    model: torch.nn.Module, gm: fx.GraphModule, fixed: list[FixedSize]
) -> None:
    """Warn about the fixed sizes that were meant to stay symbolic: a batch size (dim 0) and
    any size of an integer input (token ids: every dim a batch or sequence one). A float
    input's other sizes may be features or channels that a weight's shape fixes, as the model
    means; they go unmentioned (every fixed size is refused at other values all the same)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    named = [
        f.describe()
        for f in fixed
        if f.dim == 0 or not placeholders[f.input].meta["val"].dtype.is_floating_point
    ]
    if named:
        warnings.warn(
            f"moec: the capture of {type(model).__name__} fixed input sizes {'; '.join(named)}: "
            "the program runs at these sizes only (a call at another size is refused)",
            stacklevel=3,
        )


def fixed_sizes(
    gm: fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict, dynamic: bool
) -> list[FixedSize]:
    """Every size of a tensor input of the captured ``gm`` that is a number, with why: the
    place in the model's code where export's shape environment made it one (a dynamic
    capture), or the static capture."""
    leaves = pytree.tree_leaves((args, kwargs))
    numbers = [
        (index, node, dim, int(size))
        for index, node in enumerate(gm.graph.find_nodes(op="placeholder"))
        if isinstance(node.meta.get("val"), torch.Tensor)
        for dim, size in enumerate(node.meta["val"].shape)
        if sym(size).is_number
    ]
    if not numbers:
        return []
    sources = _source_names(model, args, kwargs)
    sites = _specialisation_sites(gm) if dynamic else {}
    fixed = []
    for index, node, dim, size in numbers:
        base = sources.get(id(leaves[index])) if index < len(leaves) else None
        site = sites.get(f"{base}.size()[{dim}]")
        if not dynamic:
            reason = "captured with dynamic=False"
        elif site is not None:
            reason = f"made a constant at {site}"
        else:
            reason = "made a constant by the capture"
        fixed.append(FixedSize(index, node.name, dim, size, reason))
    return fixed


def _source_names(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[int, str]:
    """Export's name of every tensor input (``L['input_ids']``), by the tensor's id."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError:
        return {}
    leaves, _ = pytree.tree_flatten_with_path(dict(bound))
    return {id(leaf): "L" + pytree.keystr(path) for path, leaf in leaves}


def _specialisation_sites(gm: fx.GraphModule) -> dict[str, str]:
    """Where the model's code made each input size a number, by the size's source name
    (``L['input_ids'].size()[1]``): the code location export's shape environment recorded
    when it replaced the size's symbol by a constant."""
    shape_env = fake_mode(gm).shape_env
    if shape_env is None:
        return {}
    slocs = getattr(shape_env, "replacements_slocs", {})
    sites = {}
    for symbol, target in shape_env.replacements.items():
        sloc = slocs.get(symbol)
        if not target.is_number or sloc is None:
            continue
        where = sloc.maybe_user_loc or str(sloc).strip("() ")
        for source in shape_env.var_to_sources.get(symbol, []):
            name = source.name() if callable(source.name) else source.name
            sites[name] = where
    return sites


def _read_tied_parameters_by_one_name(gm: fx.GraphModule) -> None:
    """Read every tied parameter or buffer (one tensor under several names) through one
    ``get_attr`` of its first name in ``named_parameters()``/``named_buffers()``; export reads
    a tied tensor under the name of each module that uses it."""
    first: dict[int, str] = {}
    for name, tensor in [*gm.named_parameters(), *gm.named_buffers()]:
        first.setdefault(id(tensor), name)
    reads: dict[str, fx.Node] = {}
    for node in list(gm.graph.find_nodes(op="get_attr")):
        try:
            tensor = gm.get_parameter(str(node.target))
        except AttributeError:
            try:
                tensor = gm.get_buffer(str(node.target))
            except AttributeError:  # a submodule or constant
                continue
        name = first.get(id(tensor), str(node.target))
        if name in reads:
            node.replace_all_uses_with(reads[name])
            gm.graph.erase_node(node)
        else:
            node.target = name
            reads[name] = node


def _drop_export_wrappers(gm: fx.GraphModule) -> None:
    """Remove what ``ExportedProgram.module()`` sets on the module besides its graph: the input
    check and nn.Module-input hooks (local lambdas, which cannot be pickled; the flat calling
    convention bypasses them) and the instance ``train``/``eval`` that raise. The module then
    pickles and switches modes as any ``nn.Module`` does."""
    gm._forward_pre_hooks.clear()
    gm._forward_hooks.clear()
    gm._forward_hooks_always_called.clear()
    for name in ("train", "eval"):
        gm.__dict__.pop(name, None)


def _drop_input_guards(gm: fx.GraphModule) -> None:
    """Remove export's ``_guards_fn`` call: neither fake propagation nor our flat calling
    convention can run it. Inputs outside the sizes the model supports (a sequence longer than
    its position table) still fail, with the shape error of the op that cannot take them."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
            delattr(gm, "_guards_fn")


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove export's ``aten._assert_tensor_metadata`` checks. Export puts one before every
    ``.to(dtype)`` to pin its input's captured dtype; passes change dtypes (bf16 casts, bf16 MoE
    outputs) and autocast changes them at run time, and the ``.to`` after the check is what
    converts. The checks read nothing downstream, so removing them changes no value."""
    for node in gm.graph.find_nodes(
        op="call_function", target=torch.ops.aten._assert_tensor_metadata.default
    ):
        gm.graph.erase_node(node)


def _inline_higher_order_ops(gm: fx.GraphModule) -> None:
    """Inline export's region ops into the flat graph, innermost last, each inlined node with
    a fresh ``meta["val"]``:

    - ``wrap_with_set_grad_enabled(enabled, body, *args)``: the body's nodes; with grad disabled
      each tensor output is ``aten.detach``-ed, so no gradient flows out of the region (as in
      the eager ``no_grad`` block);
    - ``wrap_with_autocast(device, dtype, enabled, cache, body, *args)``: the body's nodes; when
      enabled, every node whose floating output dtype autocast would change reads its floating
      inputs cast to that dtype (explicit ``_to_copy``), so the graph computes what the
      autocast region did without running under autocast.

    Any other higher-order op (``cond``, ``map``, ...) is a :class:`CaptureError`."""
    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")])
    while True:
        regions = [
            n
            for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
        ]
        if not regions:
            return
        for node in regions:
            _inline_region(gm, node, mode)


def _inline_region(gm: fx.GraphModule, node: fx.Node, mode: FakeTensorMode | None) -> None:
    name = getattr(node.target, "__name__", str(node.target))
    if name == "wrap_with_set_grad_enabled":
        (grad_enabled, body_node, *args), autocast = node.args, None
    elif name == "wrap_with_autocast":
        device, dtype, enabled, _cache, body_node, *args = node.args
        autocast = (device, dtype) if enabled else None
        grad_enabled = True
    else:
        raise CaptureError(
            f"the captured graph has a {name} region (node {node.name}, module "
            f"{module_path(node) or '<root>'}); moec inlines only wrap_with_set_grad_enabled and "
            "wrap_with_autocast regions: rewrite that part of the model without it "
            "(e.g. torch.where instead of torch.cond)"
        )
    body = getattr(gm, str(body_node.target))
    env: dict[fx.Node, Any] = {}
    placeholders = body.graph.find_nodes(op="placeholder")
    env.update(zip(placeholders, args, strict=True))
    with gm.graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "call_function":
                env[inner] = _inline_node(gm.graph, inner, env, node, mode, autocast)
            elif inner.op == "get_attr":
                env[inner] = gm.graph.get_attr(str(inner.target))
                env[inner].meta.update(inner.meta)
        outputs = [
            env[o] if isinstance(o, fx.Node) else o for o in body.graph.output_node().args[0]
        ]
        if not grad_enabled:
            outputs = [_detached(gm.graph, o, node, mode) for o in outputs]
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise CaptureError(f"{name} node {node.name} is read by {user.name} directly")
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    if not body_node.users:
        gm.graph.erase_node(body_node)
        if not gm.graph.find_nodes(op="get_attr", target=body_node.target):
            delattr(gm, str(body_node.target))


def _inline_node(
    graph: fx.Graph,
    inner: fx.Node,
    env: dict[fx.Node, Any],
    region: fx.Node,
    mode: FakeTensorMode | None,
    autocast: tuple[str, torch.dtype] | None,
) -> fx.Node:
    """A copy of body node ``inner`` in ``graph``, its inputs cast as ``autocast`` would."""
    args, kwargs = pytree.tree_map_only(fx.Node, env.__getitem__, (inner.args, inner.kwargs))
    if autocast is not None and isinstance(inner.target, torch._ops.OpOverload):
        dtype = _autocast_dtype(inner.target, args, kwargs, mode, autocast)
        if dtype is not None:
            args, kwargs = pytree.tree_map_only(
                fx.Node,
                lambda n: _cast(graph, n, dtype, region, mode),
                (args, kwargs),
            )
    node = graph.call_function(inner.target, args, kwargs)
    node.meta.update(inner.meta)
    node.meta.setdefault("nn_module_stack", region.meta.get("nn_module_stack", {}))
    node.meta["val"] = _fake_call(inner.target, args, kwargs, mode)
    return node


def _autocast_dtype(
    op: Any, args: tuple, kwargs: dict, mode: FakeTensorMode | None, autocast: tuple
) -> torch.dtype | None:
    """The dtype autocast gives ``op``'s floating output where it differs from plain dtype
    rules (the dtype autocast casts its floating inputs to), else None."""
    plain = _fake_call(op, args, kwargs, mode)
    with torch.autocast(autocast[0], dtype=autocast[1]):
        cast = _fake_call(op, args, kwargs, mode)
    if not (isinstance(plain, torch.Tensor) and isinstance(cast, torch.Tensor)):
        return None
    if plain.dtype == cast.dtype or not cast.dtype.is_floating_point:
        return None
    return cast.dtype


def _fake_call(op: Any, args: tuple, kwargs: dict, mode: FakeTensorMode | None) -> Any:
    fake_args, fake_kwargs = pytree.tree_map_only(
        fx.Node, lambda n: n.meta.get("val"), (args, kwargs)
    )
    with symbolic_dispatch(mode):
        return op(*fake_args, **fake_kwargs)


def _cast(
    graph: fx.Graph, node: fx.Node, dtype: torch.dtype, region: fx.Node, mode: Any
) -> fx.Node:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == dtype:
        return node
    return _derived(graph, torch.ops.aten._to_copy.default, node, {"dtype": dtype}, region, mode)


def _detached(graph: fx.Graph, value: Any, region: fx.Node, mode: Any) -> Any:
    if not (isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)):
        return value
    return _derived(graph, torch.ops.aten.detach.default, value, {}, region, mode)


def _derived(
    graph: fx.Graph, op: Any, source: fx.Node, kwargs: dict, region: fx.Node, mode: Any
) -> fx.Node:
    node = graph.call_function(op, (source,), kwargs)
    node.meta["nn_module_stack"] = dict(
        source.meta.get("nn_module_stack") or region.meta.get("nn_module_stack") or {}
    )
    node.meta["val"] = _fake_call(op, (source,), kwargs, mode)
    return node


def _auto_dims(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``Dim.AUTO`` on every dimension of every tensor input, keyed by parameter name."""

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {d: Dim.AUTO for d in range(x.dim())}
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {
        name: pytree.tree_map(spec, value, is_leaf=lambda x: x is None)
        for name, value in bound.arguments.items()
    }


def _check_example_sizes(args: tuple, kwargs: dict, dynamic: bool) -> None:
    if not dynamic:
        return
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and 1 in leaf.shape[:2]:
            raise CaptureError(
                f"example input of shape {tuple(leaf.shape)} has a batch or sequence size of 1; "
                "export would specialise that dimension to 1 and every other size would "
                "recapture. Give examples with batch >= 2 and sequence >= 2"
            )


def _explain(model: torch.nn.Module, exc: Exception, dynamic: bool) -> str:
    name = type(model).__name__
    hints = [
        "check that model(*example_inputs) runs eagerly",
        "data-dependent Python control flow (if on tensor values) cannot be captured: "
        "rewrite it with torch.where / torch.cond",
    ]
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        hints.insert(0, "this looks like a transformers model: build it with use_cache=False")
    if dynamic:
        hints.append("if the error is about dynamic shapes, try dynamic=False")
    lines = "\n".join(f"  - {h}" for h in hints)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"could not capture {name} with torch.export (strict=False): {first}\ntry:\n{lines}"
