"""Materialize a program's parameters and buffers on one rank from a dense checkpoint, or from
freshly initialized dense tensors (:class:`FreshInit`).

A model built on the meta device is captured and compiled on shapes; :func:`materialize` then
gives each parameter of ``program.graph`` its real value on ``device`` from the parameter's
provenance (``program.source(name)``, recorded by the passes: a source tensor, an upcycled /
granular / split / drop-upcycled / freshly drawn expert tensor, this rank's ``ExpertSlice`` of
one, a scaled shared-expert projection). Only what this rank holds is built, and only the parts
of the source tensors it needs are read: an expert-parallel rank reads the rows (or columns)
of its experts' slices, an upcycled expert tensor reads its dense tensor once and repeats it,
``random`` and ``drop_upcycle`` experts draw only this rank's experts, each from seeds of its
own (reading the dense FFN matrices whole, for their statistics).

Pipelined programs (``program.pipeline``; ``pp_rank`` required): only the parameters and
buffers that the stages of ``pp_rank`` read (``Pipeline.local_stages``) are built and only
their checkpoint tensors read; the other stages' stay on the meta device, for the pipeline
runtime to free (:mod:`moec.runtime.pipeline`). A stage graph holds the full graph's tensor
objects, so each built tensor replaces the old one in the full graph and in every stage graph
holding it. The full graph's forward then raises, naming a parameter left on meta (it is
not this rank's to run). With ``every_stage`` every stage's tensors are built instead (no
``pp_rank``): the full graph runs, and a pipeline runtime frees the other ranks' stages itself,
as it does those of a program captured from real tensors.

Sources (:func:`open_source`): a Hugging Face safetensors directory (``model.safetensors``, or
the shards named by ``model.safetensors.index.json``), one ``.safetensors`` file (read slice
by slice with ``safe_open(...).get_slice``), a torch state dict, or a file holding one.

A live model holding real tensors (:class:`ModuleSource`: ``moec.compile(model, ...,
check=...)`` builds the program on the meta device, checks it, then materializes it from the
model): a parameter the program holds unchanged (its source is the model's tensor of that name,
already on ``device`` with the program's dtype, shape, strides and ``requires_grad``) and each
buffer the model holds become the model's own tensor objects, as the capture of a model holding
real tensors shares them; only what the passes made (experts, scaled projections, working
copies) is built.

Training from scratch (:class:`FreshInit`): the source model's parameters freshly initialized,
one owning module at a time on the CPU, so a model too big for one device is never built
whole. Parameter ``a.b.weight`` is made by a copy of module ``a.b`` alone, allocated
(``to_empty(recurse=False)``) and filled by the first initializer that leaves none of its
parameters NaN (the model's ``_init_weights(module)``, the module's ``reset_parameters()``),
drawing from a CPU generator of its own seeded with ``fresh_seed(seed, "a.b")``: the values
``torch.manual_seed`` of that seed would give, while the caller's random states (CPU and GPU)
are neither read nor moved (:mod:`moec.runtime.seeded_draws`; an initializer calling an op
that takes no generator draws from the global one instead, seeded the same, one module at a
time, the caller's state restored). A value thus depends only on the seed and its module's
path: every layout (dp, dp_shard, ep, pp) builds the same global tensors as one process,
whatever it reads and in which order. The last module's tensors are kept, so its several
parameters are made once. :func:`materialize` has the modules it will read drawn ahead on
background threads, several at once (:meth:`FreshInit.prefetch`, up to
:attr:`FreshInit.AHEAD_BYTES` ahead of the reads), beside its copies and expert draws; a read
the prefetch did not foresee is drawn when it comes, to the same values.
A tied parameter is its first holder's. An initializer that a parent module applies to its
children (e.g. a scaled residual projection set by the block's ``_init_weights``) is not
applied: only the owning module's is. A parameter no initializer fills raises
:class:`MaterializeError` naming it and what was tried.

Buffers: a persistent buffer is read from the checkpoint. A non-persistent one (RoPE tables)
is not in a checkpoint, so it is recomputed on the CPU by the source model's own code: the
module owning it is copied, its tensors allocated (``to_empty``) and filled with NaN, then
the first initializer that leaves no NaN wins: the module rebuilt by its ``__init__`` from its
``config`` (transformers' rotary embeddings), the model's ``_init_weights(module)``, the
module's ``reset_parameters()``. A buffer neither the checkpoint nor an initializer produces
raises :class:`MaterializeError` naming it. A buffer of the graph that is already real is
moved to ``device``. A parameter FSDP shards (a ``DTensor``, see :mod:`moec.runtime.fsdp`)
is built whole, one at a time, and only this rank's shard of it kept. The bf16 working-weight
copies (``program.working_weights``) are rewritten from the materialized parameters, and the
``meta`` device the capture baked into the graph's calls (``arange``, ``to``) becomes
``device`` in the graphs this rank runs (the full graph, or its own stage graphs).

Errors (:class:`MaterializeError`) name the parameter or buffer, the checkpoint tensor and the
checkpoint: a tensor the checkpoint lacks, a checkpoint tensor whose shape differs from the
model's, a built parameter whose shape differs from the program's.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import json
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moec.errors import MoecError
from moec.ops.working_weights import joined_copy
from moec.program import (
    FromSource,
    ParamSource,
    Pipeline,
    Program,
    TensorBuilder,
    cut,
    fresh_seed,
    source_reads,
)
from moec.runtime.seeded_draws import UnseededDraw, global_generator, private_generator

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class MaterializeError(MoecError, ValueError):
    """A parameter or buffer of the program cannot be produced from the given source."""


@dataclasses.dataclass(frozen=True)
class Read:
    """One read of a source tensor: ``name[rows, cols]`` (None: the whole dim)."""

    name: str
    rows: slice | None
    cols: slice | None
    shape: tuple[int, ...]


class TensorSource(abc.ABC):
    """Named tensors read by parts; ``reads`` logs every read made."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.reads: list[Read] = []

    @abc.abstractmethod
    def __contains__(self, name: str) -> bool:
        """Whether the source holds a tensor ``name``."""

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor ``name``."""

    @abc.abstractmethod
    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Tensor ``name`` indexed by ``index`` (one slice per leading dim)."""

    def lend(self, name: str) -> torch.Tensor | None:
        """The source's own tensor object ``name``, for a program to hold as it is; None (every
        source but :class:`ModuleSource`): its tensors are only read."""
        return None

    def prefetch(self, names: Iterable[str]) -> None:
        """Tensors ``names`` will be read in this order: a source may make them ahead, until
        :meth:`close` (the default makes each when it is read)."""
        return None

    def close(self) -> None:
        """Stop making tensors ahead and drop those made and not read."""
        return None

    def read(self, name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        """Tensor ``name`` cut to ``[rows, cols]`` (None: the whole dim)."""
        if name not in self:
            raise MaterializeError(
                f"{self.where} has no tensor {name!r}, which the program needs: pass the "
                "checkpoint of the model that was compiled (its state-dict names)"
            )
        index = (rows or slice(None),) + (() if cols is None else (cols,))
        value = self._read(name, index)
        self.reads.append(Read(name, rows, cols, tuple(value.shape)))
        return value


class StateDictSource(TensorSource):
    def __init__(self, state: Mapping[str, torch.Tensor], where: str = "the state dict") -> None:
        super().__init__(where)
        self.state = state

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        rows, cols = index[0], index[1] if len(index) > 1 else None
        return cut(self.state[name].detach(), rows, cols)


class ModuleSource(StateDictSource):
    """The real tensors of a live ``module`` by their names in it (a tied parameter under each of
    its names, non-persistent buffers included; a tensor on the meta device is not in it), lent
    as they are (:meth:`lend`) where the program holds one unchanged (see the module)."""

    def __init__(self, module: nn.Module) -> None:
        named = [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
        real = {name: t for name, t in named if t.device.type != "meta"}
        super().__init__(real, f"the tensors of {type(module).__name__}")

    def lend(self, name: str) -> torch.Tensor | None:
        return self.state.get(name)


class SafetensorsSource(TensorSource):
    """Safetensors files; a tensor's parts are read with ``get_slice`` (only those bytes)."""

    def __init__(self, files: Mapping[str, Path], where: str) -> None:
        super().__init__(where)
        self.files = files
        """Tensor name -> the file holding it."""
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str) -> Any:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return self._handles[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._slice(name)[index]


class SubmoduleSource(TensorSource):
    """``inner``'s tensors named as a module that holds the checkpoint's model at ``prefix``
    sees them (a loss wrapper holding the model as ``model``: prefix ``"model."``)."""

    def __init__(self, inner: TensorSource, prefix: str) -> None:
        super().__init__(f"{inner.where} (as {prefix}*)")
        self.inner, self.prefix = inner, prefix

    def _inner_name(self, name: str) -> str | None:
        return name[len(self.prefix) :] if name.startswith(self.prefix) else None

    def __contains__(self, name: str) -> bool:
        inner = self._inner_name(name)
        return inner is not None and inner in self.inner

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(self._inner_name(name))

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.inner._read(self._inner_name(name), index)

    def prefetch(self, names: Iterable[str]) -> None:
        self.inner.prefetch(n for n in map(self._inner_name, names) if n is not None)

    def close(self) -> None:
        self.inner.close()


class FreshInit(TensorSource):
    """``model``'s parameters freshly initialized from ``seed``, each owning module alone (see
    the module docstring). Without ``model`` it is a marker: :func:`materialize` binds it to the
    model it is given (``moec.compile(meta_model, plan, example, init_from=FreshInit(seed=0))``)."""

    DRAWERS = min(8, os.cpu_count() or 1)
    """Threads :meth:`prefetch` draws modules on, at once (each module from a generator of
    its own)."""
    AHEAD_BYTES = 2 << 30
    """How many bytes of drawn modules :meth:`prefetch` holds ahead of the reads (at least
    one module)."""

    def __init__(self, seed: int, model: nn.Module | None = None) -> None:
        super().__init__(f"FreshInit(seed={seed})")
        self.seed, self.model = seed, model
        self._owners: dict[str, tuple[str, str]] = {}
        """Parameter name -> (module path, attribute) of the first module holding it."""
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None
        """The last initialized module's path and its parameters, by attribute."""
        self._global_generator = threading.Lock()
        """Held while an initializer draws from the global generator (one that calls an op
        taking no generator: :mod:`moec.runtime.seeded_draws`)."""
        self._upcoming: deque[str] = deque()
        self._bytes: dict[str, int] = {}
        """Module path -> the bytes of its parameters, for the modules :meth:`prefetch` draws."""
        self._drawn: dict[str, Future[dict[str, torch.Tensor]]] = {}
        self._drawer: ThreadPoolExecutor | None = None
        first: dict[int, tuple[str, str]] = {}
        for path, module in [] if model is None else model.named_modules(remove_duplicate=False):
            for attr, param in module._parameters.items():
                if param is not None:
                    owner = first.setdefault(id(param), (path, attr))
                    self._owners[f"{path}.{attr}" if path else attr] = owner

    def uses_module_defaults(self) -> bool:
        """Whether the bound model has no ``_init_weights(module)``: every module is then
        drawn by its own ``reset_parameters()``, so initialization the model's ``__init__``
        applies after its modules' own (a smaller std, zero biases) is not reproduced."""
        return _model_initializer(self.model) is None

    def bound(self, model: nn.Module | None) -> FreshInit:
        """This source, bound to ``model`` if it is not bound yet."""
        if self.model is not None:
            return self
        if model is None:
            raise MaterializeError(
                f"{self.where} has no model to initialize: pass the source model "
                "(materialize(..., model=...); moec.compile passes the model it compiles) or "
                "FreshInit(seed, model)"
            )
        return FreshInit(self.seed, model)

    def __contains__(self, name: str) -> bool:
        return name in self._owners

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.model.get_parameter(name).shape)

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        path, attr = self._owners[name]
        rows, cols = index[0], index[1] if len(index) > 1 else None
        return cut(self._module_tensors(path, name)[attr], rows, cols)

    def prefetch(self, names: Iterable[str]) -> None:
        """Draw the modules holding parameters ``names`` on :attr:`DRAWERS` background threads,
        in the order of their first appearance, at most :attr:`AHEAD_BYTES` ahead of the
        reads; :meth:`close` stops it."""
        paths = dict.fromkeys(self._owners[n][0] for n in names if n in self._owners)
        self._upcoming = deque(paths)
        for path in paths:
            own = self.model.get_submodule(path)._parameters.values()
            self._bytes[path] = sum(p.numel() * p.element_size() for p in own if p is not None)
        self._drawer = self._drawer or ThreadPoolExecutor(
            self.DRAWERS, thread_name_prefix="fresh-init"
        )
        self._draw_ahead()

    def close(self) -> None:
        """Stop drawing ahead and drop what was drawn and not read."""
        self._upcoming.clear()
        for future in self._drawn.values():
            future.cancel()
        self._drawn.clear()
        if self._drawer is not None:
            self._drawer.shutdown(wait=True)
            self._drawer = None

    def _draw_ahead(self) -> None:
        while self._drawer is not None and self._upcoming:
            held = sum(self._bytes[p] for p in self._drawn)
            if self._drawn and held + self._bytes[self._upcoming[0]] > self.AHEAD_BYTES:
                return
            path = self._upcoming.popleft()
            self._drawn[path] = self._drawer.submit(self._draw, path, None)

    def _module_tensors(self, path: str, name: str) -> dict[str, torch.Tensor]:
        if self._last is not None and self._last[0] == path:
            return self._last[1]
        self._last = None  # the previous module's tensors are dropped before the next is built
        ahead = self._drawn.pop(path, None)
        # what failed ahead is drawn again here, to raise naming the parameter read
        ahead_ok = ahead is not None and ahead.exception() is None
        filled = ahead.result() if ahead_ok else self._draw(path, name)
        self._last = (path, filled)
        self._draw_ahead()
        return filled

    def _draw(self, path: str, name: str | None) -> dict[str, torch.Tensor]:
        """The parameters of module ``path`` from the first initializer that fills them all;
        ``name`` (or the module's first parameter) is named if none does."""
        module = self.model.get_submodule(path)
        attrs = [a for a, p in module._parameters.items() if p is not None]
        initializers = _initializers(self.model, module)
        seed = fresh_seed(self.seed, path)
        for initialize in initializers:
            try:  # a generator of its own: drawn beside the other threads
                filled = _filled(initialize, module, attrs, private_generator(seed))
            except UnseededDraw:  # an op taking no generator: the global one, alone
                with self._global_generator:
                    filled = _filled(initialize, module, attrs, global_generator(seed))
            if filled is not None:
                return filled
        name = name or (f"{path}.{attrs[0]}" if path else attrs[0])
        tried = ", ".join(i.__name__ for i in initializers) or "none"
        raise MaterializeError(
            f"parameter {name}: {self.where} found no initializer that fills the parameters of "
            f"its module {path or '<root>'} ({type(module).__name__}) alone on the CPU (tried: "
            f"{tried}; accepted: the model's _init_weights(module), the module's "
            "reset_parameters()): give the module a reset_parameters() or initialize from a "
            "checkpoint"
        )


DenseSource = str | os.PathLike | Mapping[str, torch.Tensor] | TensorSource
"""The dense model's weights ``init_from`` upcycles from (a source, not a training
checkpoint of moec's): a dense checkpoint's path, a state dict, or an opened source
(:class:`FreshInit` included)."""


def open_source(source: DenseSource) -> TensorSource:
    """The :class:`TensorSource` of a checkpoint directory or file, or of a state dict."""
    if isinstance(source, TensorSource):
        return source
    if isinstance(source, Mapping):
        return StateDictSource(source)
    path = Path(source)
    if path.is_dir() and (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        where = f"checkpoint {path / INDEX_FILE}"
        return SafetensorsSource({k: path / v for k, v in weight_map.items()}, where)
    if path.is_dir() and (path / SINGLE_FILE).is_file():
        path = path / SINGLE_FILE
    if path.is_file() and path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names = list(handle.keys())
        return SafetensorsSource(dict.fromkeys(names, path), f"checkpoint {path}")
    if path.is_file() and path.suffix in (".pt", ".pth", ".bin"):
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return StateDictSource(state, f"checkpoint {path}")
    raise MaterializeError(
        f"cannot read a checkpoint at {path}: expected a directory holding {SINGLE_FILE} or "
        f"{INDEX_FILE} (save_pretrained's safetensors), a .safetensors file, a torch state "
        "dict file (.pt, .pth, .bin), or a state dict"
    )


def materialize(
    program: Program,
    source: DenseSource,
    device: torch.device | str = "cpu",
    model: nn.Module | None = None,
    *,
    pp_rank: int | None = None,
    every_stage: bool = False,
) -> TensorSource:
    """Replace every parameter and buffer of ``program.graph`` that this rank holds by its real
    value on ``device`` (see the module docstring), reading ``source``; return the opened
    source (its ``reads``).

    ``model``: the source model the program was compiled from (typically on the meta device);
    when given, every checkpoint tensor read is checked against the shape of the model's
    tensor of that name, and non-persistent buffers are recomputed by its initializer. An
    unbound :class:`FreshInit` is bound to it (required then).
    ``pp_rank``: this rank's pipeline rank (``PipelineMesh.pp_rank``), required exactly when
    the program is pipelined and not ``every_stage``: only the tensors of the stages it holds
    are built (``every_stage``: those of every stage, see the module)."""
    held = None if every_stage else _held_tensors(program, pp_rank)
    device = torch.device(device)
    tensors = open_source(source)
    if isinstance(tensors, FreshInit):
        tensors = tensors.bound(model)
    expected = {} if model is None else _shapes(model)
    read = _checked_reader(tensors, expected)
    gm = program.graph
    split = program.pipeline
    holders = _Holders([gm] + ([] if split is None else [s.graph for s in split.stages]))
    params = [(n, p) for n, p in gm.named_parameters() if held is None or id(p) in held]
    tensors.prefetch(r for n, _ in params for r in source_reads(program.source(n)))
    try:
        for name, param in params:  # a builder each: nothing read is kept
            lent = _lent(tensors, name, program.source(name), param, device)
            if lent is not None:
                holders.replace(param, lent)
                continue
            value = _build(TensorBuilder(read, device), program.source(name), param, name)
            if isinstance(param, DTensor):  # an FSDP shard (moec.runtime.fsdp): this rank's
                value = _shard_of(value, param)
            holders.replace(param, nn.Parameter(value, param.requires_grad))
    finally:
        tensors.close()
    initial = None
    for name, buffer in list(gm.named_buffers()):
        if name in program.working_weights or (held is not None and id(buffer) not in held):
            continue
        if name in tensors:
            value = tensors.lend(name)
            value = tensors.read(name, None, None) if value is None else value
        elif buffer.device.type != "meta":
            value = buffer
        else:
            initial = initial if initial is not None else _initial_buffers(model)
            if name not in initial:
                raise MaterializeError(
                    f"buffer {name} is neither in {tensors.where} nor recomputed by the "
                    f"source model's initializer ({_initializer_text(model)}): build the "
                    "model with it on a real device or save it in the checkpoint"
                )
            value = initial[name]
        holders.replace(buffer, value.to(device=device, dtype=buffer.dtype))
    copies = {
        b: names
        for b, names in program.working_weights.items()
        if held is None or id(gm.get_buffer(b)) in held
    }
    _refresh_working_weights(gm, copies, holders)
    if split is None or every_stage:
        for graph in [gm] + ([] if split is None else [s.graph for s in split.stages]):
            _retarget_devices(graph, device)
    else:  # only this rank's stage graphs run; the full graph reads other stages' tensors
        for s in split.local_stages(pp_rank):
            _retarget_devices(split.stages[s].graph, device)
        _refuse_full_graph(gm, split, pp_rank)
    return tensors


def _lent(
    tensors: TensorSource,
    name: str,
    source: ParamSource,
    param: torch.Tensor,
    device: torch.device,
) -> nn.Parameter | None:
    """The source's own parameter ``name`` where the program holds it unchanged: its source is
    that tensor whole, a parameter already on ``device`` with ``param``'s dtype, shape, strides
    and ``requires_grad``; else None (the value is built)."""
    own = tensors.lend(name) if source == FromSource(name) else None
    if not isinstance(own, nn.Parameter) or isinstance(param, DTensor):
        return None
    wanted = (device, param.dtype, param.shape, param.stride(), param.requires_grad)
    same = (own.device, own.dtype, own.shape, own.stride(), own.requires_grad) == wanted
    return own if same else None


def lost_constants(program: Program) -> list[str]:
    """The tensor constants of ``program``'s graph (read by ``get_attr``, neither parameter nor
    buffer) that are on the meta device: a tensor the model's forward made on its inputs'
    device (``torch.tensor(..., device=x.device)``) has, captured on the meta device, no value
    that :func:`materialize` could give it."""
    gm = program.graph
    held = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    named = {n for n, _ in held}
    lost = []
    for node in gm.graph.find_nodes(op="get_attr"):
        target = str(node.target)
        *path, leaf = target.split(".")
        value = getattr(gm.get_submodule(".".join(path)), leaf, None)
        if target not in named and isinstance(value, torch.Tensor) and value.is_meta:
            lost.append(target)
    return lost


def _held_tensors(program: Program, pp_rank: int | None) -> set[int] | None:
    """The ids of the parameters and buffers the stages of ``pp_rank`` read; None (every
    tensor) for a program that is not pipelined."""
    split = program.pipeline
    if split is None:
        if pp_rank is not None:
            raise MaterializeError(
                f"materialize: pp_rank={pp_rank} was given but the program is not pipelined "
                "(plan.parallel.pp = 1): leave pp_rank None"
            )
        return None
    if pp_rank is None or not 0 <= pp_rank < split.pp:
        raise MaterializeError(
            f"materialize: the program is pipelined over parallel.pp={split.pp} ranks, so "
            f"pp_rank must be this rank's pipeline rank in [0, {split.pp}), got {pp_rank} "
            "(moec.compile passes the mesh's: mesh=build_pipeline_mesh(plan))"
        )
    graphs = [split.stages[s].graph for s in split.local_stages(pp_rank)]
    return {id(t) for g in graphs for t in [*g.parameters(), *g.buffers()]}


def _refuse_full_graph(gm: fx.GraphModule, split: Pipeline, pp_rank: int) -> None:
    """Make ``gm``'s forward raise, naming a parameter left on the meta device (another pipeline
    rank's): run on meta weights it would return meta (or garbage) values instead of failing."""
    local = set(split.local_stages(pp_rank))
    unbuilt = [
        (name, s)
        for s, stage in enumerate(split.stages)
        if s not in local
        for name, _ in stage.graph.named_parameters()
    ]
    if not unbuilt:
        return
    name, stage = unbuilt[0]

    def refuse(module: nn.Module, args: Any) -> None:
        raise MaterializeError(
            f"parameter {name!r} of pipeline stage {stage} (pipeline rank "
            f"{split.info[stage].rank}) was not materialized on this process (pipeline rank "
            f"{pp_rank}), which builds only its own stages from the checkpoint: train it with "
            "moec.train (the Trainer), whose pipeline runtime runs this rank's stages"
        )

    gm.register_forward_pre_hook(refuse)


def _shard_of(value: torch.Tensor, param: DTensor) -> DTensor:
    """This rank's shard of ``value``, laid out as ``param`` (no communication)."""
    mesh, placements = param.device_mesh, param.placements
    local = distribute_tensor(value, mesh, placements, src_data_rank=None).to_local()
    # a copy: a view would keep the whole tensor alive
    return DTensor.from_local(local.clone(), mesh, placements, run_check=False)


def _retarget_devices(gm: fx.GraphModule, device: torch.device) -> None:
    """Point the ``meta`` devices the capture of a meta model baked into the graph's calls
    (``arange(..., device=meta)``, ``to(x, meta)``) at ``device``."""

    def retarget(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    changed = False
    for node in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), retarget)
        if (args, kwargs) != (node.args, node.kwargs):
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()


def _build(
    builder: TensorBuilder, source: ParamSource, param: torch.Tensor, name: str
) -> torch.Tensor:
    """``param``'s value from ``source``: one copy of what the builder made into a new tensor
    of the program's dtype and layout (k-major expert weights: lowering.expert_weights)."""
    value = builder.build(source)
    if value.shape != param.shape:  # a DTensor's shape is the whole tensor's
        raise MaterializeError(
            f"parameter {name}: the program has shape {tuple(param.shape)} but its source "
            f"{source} gives {tuple(value.shape)}"
        )
    if isinstance(param, DTensor):  # built whole, then sharded
        return torch.empty(value.shape, dtype=param.dtype, device=builder.device).copy_(value)
    out = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=builder.device)
    return out.copy_(value)


def _checked_reader(tensors: TensorSource, expected: Mapping[str, torch.Size]):
    def read(name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        if name in expected and name in tensors and tensors.shape(name) != tuple(expected[name]):
            raise MaterializeError(
                f"{tensors.where}: tensor {name} has shape {tensors.shape(name)} but the "
                f"model's {name} has shape {tuple(expected[name])}: the checkpoint is of "
                "another model (or configuration)"
            )
        return tensors.read(name, rows, cols)

    return read


def _shapes(model: nn.Module) -> dict[str, torch.Size]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return {name: t.shape for name, t in named}


class _Holders:
    """Every attribute holding each parameter or buffer in ``modules`` (the full graph and its
    pipeline stage graphs, which hold the same tensor objects under their own submodules), so
    that replacing a tensor replaces it everywhere (tied parameters stay tied)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._at: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in modules:
            for owner in module.modules():
                for attr, t in [*owner._parameters.items(), *owner._buffers.items()]:
                    if t is not None:
                        self._at.setdefault(id(t), []).append((owner, attr))

    def replace(self, old: torch.Tensor, new: torch.Tensor) -> None:
        for owner, attr in self._at.pop(id(old), []):
            if isinstance(new, nn.Parameter):
                setattr(owner, attr, new)
            else:  # keeps the buffer's persistence, which is by name
                owner._buffers[attr] = new


def _refresh_working_weights(
    gm: fx.GraphModule, copies: Mapping[str, list[str]], holders: _Holders
) -> None:
    """Each working-weight buffer: the bf16 rows of its parameters, as the pass made it."""
    for name, params in copies.items():
        buffer = gm.get_buffer(name)
        masters = [gm.get_parameter(p).detach() for p in params]
        holders.replace(buffer, joined_copy(masters, buffer.dtype, masters[0].device))


def _initializer_text(model: nn.Module | None) -> str:
    if model is None:
        return "no source model was given"
    return "tried: its owner rebuilt from its config, _init_weights, reset_parameters"


def _initial_buffers(model: nn.Module | None) -> dict[str, torch.Tensor]:
    """The meta float buffers of ``model`` that an initializer fills, computed on the CPU, by
    name. Per module owning some, the first of these that fills them all (no NaN left) wins:
    the module rebuilt by its own ``__init__`` from its ``config`` when it holds no parameters
    (transformers' rotary embeddings), the model's ``_init_weights(module)``, the module's
    ``reset_parameters()``."""
    if model is None:
        return {}
    values: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        metas = [n for n, b in module.named_buffers(recurse=False) if b.device.type == "meta"]
        metas = [n for n in metas if module.get_buffer(n).is_floating_point()]
        for initialize in _initializers(model, module):
            filled = _filled(initialize, module, metas)
            if filled is not None:
                values.update({f"{path}.{n}" if path else n: filled[n] for n in metas})
                break
    return values


def _initializers(model: nn.Module, module: nn.Module) -> list[Callable[[nn.Module], Any]]:
    """Ways to fill ``module``'s tensors in place of a CPU copy of it, in the order tried (see
    _initial_buffers and FreshInit); each is named by its ``__name__``."""
    found: list[Callable[[nn.Module], Any]] = []
    has_params = any(True for _ in module.parameters())
    if getattr(module, "config", None) is not None and not has_params:  # small modules only
        found.append(_rebuild_from_config)
    if (initializer := _model_initializer(model)) is not None:
        found.append(initializer)
    if callable(getattr(module, "reset_parameters", None)):
        found.append(_reset_parameters)
    return found


def _model_initializer(model: nn.Module | None) -> Callable[[nn.Module], Any] | None:
    """The model's ``_init_weights(module)`` (transformers' name), if it has one."""
    initializer = getattr(model, "_init_weights", None)
    return initializer if callable(initializer) else None


def _reset_parameters(clone: nn.Module) -> None:
    clone.reset_parameters()


def _rebuild_from_config(clone: nn.Module) -> None:
    with torch.device("cpu"):
        fresh = type(clone)(clone.config)
    for name, buffer in clone.named_buffers(recurse=False):
        buffer.copy_(fresh.get_buffer(name))


def _filled(
    initialize: Callable[[nn.Module], Any],
    module: nn.Module,
    names: list[str],
    draws: contextlib.AbstractContextManager | None = None,
) -> dict[str, torch.Tensor] | None:
    """Tensors ``names`` (``module``'s own parameters or buffers) of a CPU copy of ``module``
    (allocated, NaN) after ``initialize`` ran on it, under ``draws`` (the generator it draws
    from, :mod:`moec.runtime.seeded_draws`); None if it raised or left a NaN."""
    if not names:
        return None
    clone = copy.deepcopy(module).to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for name in names:
            _own(clone, name).fill_(math.nan)
    with draws or contextlib.nullcontext(), torch.no_grad():
        try:
            initialize(clone)
        except (TypeError, ValueError, AttributeError, RuntimeError):
            return None
    filled = {name: _own(clone, name).detach() for name in names}
    return None if any(map(_holds_nan, filled.values())) else filled


def _holds_nan(t: torch.Tensor) -> bool:
    # a NaN makes the sum NaN; one pass, no mask (only +inf beside -inf could too: then look)
    return bool(t.sum().isnan()) and bool(t.isnan().any())


def _own(module: nn.Module, name: str) -> torch.Tensor:
    """``module``'s own parameter or buffer ``name``."""
    param = module._parameters.get(name)
    return param if param is not None else module._buffers[name]
