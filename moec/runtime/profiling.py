"""Profiling a window of training steps: ``moec train --profile START:STEPS``.

For the steps ``[START, START + STEPS)`` (0-based, as the trainer counts them) a
:class:`StepProfiler`:

- runs the compiled model's graph through :func:`instrument`, a copy with **ranges named by
  block**: ``block <path>`` around each residual block's forward nodes and
  ``block <path> (backward)`` from the moment the block's output gradient arrives until its
  input gradient leaves (autograd identity markers at the block's boundaries, so recompute
  regions and FSDP gathers of the block fall inside). On CUDA each ``moec::`` op (route,
  dispatch, expert_mlp, combine, the EP exchanges ``moec::ep_*``) also gets an NVTX range of
  its name; torch's profiler records those ops by name already;
- opens ``torch.profiler`` (CPU, and CUDA on a CUDA device; ``record_shapes``, ``with_stack``
  off unless asked) and, on CUDA, ``cudaProfilerStart``/``Stop`` around the window, so
  ``nsys profile --capture-range=cudaProfilerApi`` captures exactly these steps. Block ranges are
  ``record_function`` ranges (user annotations in the trace) and, on CUDA, NVTX start/end ranges
  (they may cross threads: backward runs on autograd's device thread); each step is a range
  ``step N``;
- writes ``trace_rank{r}.json`` (Chrome/Perfetto trace), ``summary_rank{r}.txt`` (torch's
  per-op table by self CUDA time, self CPU time on CPU, then per-block totals read back from
  the trace's block ranges) and ``ops_rank{r}.json`` (:func:`ops_summary`: the per-op table by
  the time model's kinds, with input shapes and device times, the GEMM and attention samples,
  the device time of the rest, and the step's shape: what ``moec plan auto --calibrate``
  fits the time model to) into its directory (``<run>/profile``), and prints the summary.

The instrumented graph computes the same values as the plain one: the markers are identities
and the ranges only record. It is used only inside the window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import operator
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from moec.analysis.cost import graph_cost
from moec.errors import MoecError
from moec.fx import module_path, owning_path
from moec.runtime import run_files
from moec.runtime.block_graphs import program_blocks as block_paths

BLOCK_PREFIX = "block "
BACKWARD_SUFFIX = " (backward)"


class ProfileError(MoecError, ValueError):
    """A ``--profile START:STEPS`` window that is malformed or does not fit the run."""


@dataclasses.dataclass(frozen=True)
class ProfileWindow:
    """Steps ``[start, start + steps)`` of the run (0-based step indices)."""

    start: int
    steps: int

    @property
    def stop(self) -> int:
        return self.start + self.steps

    @classmethod
    def parse(cls, spec: str) -> ProfileWindow:
        """``"START:STEPS"``: two integers, START >= 0 and STEPS >= 1."""
        parts = spec.split(":")
        try:
            start, steps = (int(p) for p in parts)
        except ValueError:
            raise ProfileError(
                f"--profile {spec!r}: expected START:STEPS, two integers (e.g. 10:3 profiles "
                "steps 10, 11 and 12)"
            ) from None
        if start < 0:
            raise ProfileError(f"--profile {spec!r}: START = {start} must be >= 0")
        if steps < 1:
            raise ProfileError(f"--profile {spec!r}: STEPS = {steps} must be >= 1")
        return cls(start, steps)

    def check(self, total_steps: int, first_step: int = 0) -> None:
        """The window must lie inside the steps this call runs: ``[first_step, total_steps)``
        (``first_step``: where a resumed run continues)."""
        spec = f"--profile {self.start}:{self.steps}"
        if self.stop > total_steps:
            raise ProfileError(
                f"{spec} covers steps {self.start}..{self.stop - 1}, past the run's last step "
                f"{total_steps - 1} (--steps {total_steps}): start earlier, profile fewer steps "
                "or train longer"
            )
        if self.start < first_step:
            raise ProfileError(
                f"{spec} starts at step {self.start}, but this run resumes at step "
                f"{first_step}: profile a window starting at step {first_step} or later"
            )


# --- ranges ------------------------------------------------------------------------------------


class _Range:
    """An open range: a ``record_function`` (the profiler's user annotation) and, with NVTX, an
    NVTX start/end range (not push/pop: a block's backward range may close on another thread)."""

    def __init__(self, name: str, nvtx: bool):
        self.record = torch.autograd.profiler.record_function(name)
        self.record.__enter__()
        self.nvtx_id = torch.cuda.nvtx.range_start(name) if nvtx else None

    def close(self) -> None:
        if self.nvtx_id is not None:
            torch.cuda.nvtx.range_end(self.nvtx_id)
        self.record.__exit__(None, None, None)


class BlockRanges:
    """One call of one block: its forward range, and its backward range once opened."""

    def __init__(self, name: str, nvtx: bool):
        self.name, self.nvtx = name, nvtx
        self.forward: _Range | None = _Range(name, nvtx)
        self.backward: _Range | None = None

    def end_forward(self) -> None:
        if self.forward is not None:
            self.forward.close()
            self.forward = None

    def begin_backward(self) -> None:
        if self.backward is None:
            self.backward = _Range(self.name + BACKWARD_SUFFIX, self.nvtx)

    def end_backward(self) -> None:
        if self.backward is not None:
            self.backward.close()
            self.backward = None


class _Boundary(torch.autograd.Function):
    """Identity on a block's boundary tensors whose backward opens (at the block's outputs) or
    closes (at its inputs) the block's backward range."""

    @staticmethod
    def forward(ctx: Any, ranges: BlockRanges, entering: bool, *xs: torch.Tensor) -> tuple:
        ctx.ranges, ctx.entering = ranges, entering
        ctx.set_materialize_grads(False)
        return xs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        if ctx.entering:
            ctx.ranges.end_backward()
        else:
            ctx.ranges.begin_backward()
        return (None, None, *grads)


def _through_boundary(ranges: BlockRanges, entering: bool, values: tuple) -> tuple:
    """``values`` with the tensors that require grad passed through a :class:`_Boundary` (only
    those: every output of an autograd function requires grad when one input does)."""
    marked = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad]
    if not marked:
        return values
    out = _Boundary.apply(ranges, entering, *(values[i] for i in marked))
    result = list(values)
    for i, v in zip(marked, out, strict=True):
        result[i] = v
    return tuple(result)


def block_begin(name: str, nvtx: bool, *inputs: Any) -> tuple:
    """Graph function: open ``name``'s forward range; ``(ranges, *inputs marked)``."""
    ranges = BlockRanges(name, nvtx)
    return (ranges, *_through_boundary(ranges, True, inputs))


def block_end(ranges: BlockRanges, *outputs: Any) -> tuple:
    """Graph function: close the block's forward range; its outputs, marked."""
    ranges.end_forward()
    return _through_boundary(ranges, False, outputs)


def nvtx_push(name: str) -> None:
    """Graph function: an NVTX range around one op (forward)."""
    torch.cuda.nvtx.range_push(name)


def nvtx_pop() -> None:
    torch.cuda.nvtx.range_pop()


# --- the instrumented graph --------------------------------------------------------------------


def _runs(graph: fx.Graph, blocks: set[str]) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of consecutive compute nodes owned by one block, in graph order."""
    runs: list[tuple[str, list[fx.Node]]] = []
    current: str | None = None
    for node in graph.nodes:
        if node.op not in ("call_function", "call_module", "call_method"):
            continue
        owner = owning_path(module_path(node), blocks)
        if owner is not None and owner == current:
            runs[-1][1].append(node)
        elif owner is not None:
            runs.append((owner, [node]))
        current = owner
    return runs


def _moec_op_name(node: fx.Node) -> str | None:
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        if target.namespace == "moec":
            return f"moec::{target._schema.name.split('::')[-1]}"
    return None


def _moec_packet_name(node: fx.Node) -> str | None:
    """The name of the ``moec::`` op ``node`` calls through its packet (see ``instrument``)."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverloadPacket):
        if target._qualified_op_name.startswith("moec::"):
            return target._qualified_op_name
    return None


def instrument(gm: fx.GraphModule, blocks: list[str], nvtx: bool) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters, buffers and sub-graphs) with block ranges around
    each run of a block's nodes and, with ``nvtx``, an NVTX range around each ``moec::`` op.
    Its ``moec::`` ops are called through their op packets: from torch 2.14 a Python custom op
    called through its ``OpOverload`` takes a dispatch handle that records no profiler event
    (the packet's call does), so the trace would lose their forward ranges."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if _moec_op_name(node) is not None:
            node.target = node.target.overloadpacket
    for path, nodes in _runs(graph, set(blocks)):
        member = set(nodes)
        inputs = list(
            dict.fromkeys(
                a
                for n in nodes
                for a in n.all_input_nodes
                if a not in member and a.op != "get_attr"
            )
        )
        outputs = [n for n in nodes if any(u not in member for u in n.users)]
        with graph.inserting_before(nodes[0]):
            begin = graph.call_function(block_begin, (BLOCK_PREFIX + path, nvtx, *inputs))
            ranges = graph.call_function(operator.getitem, (begin, 0))
            for i, value in enumerate(inputs):
                marked = graph.call_function(operator.getitem, (begin, i + 1))
                for node in nodes:
                    node.replace_input_with(value, marked)
        if not outputs:
            with graph.inserting_after(nodes[-1]):
                graph.call_function(block_end, (ranges,))
            continue
        users = {o: [u for u in o.users if u not in member] for o in outputs}
        with graph.inserting_after(nodes[-1]):
            end = graph.call_function(block_end, (ranges, *outputs))
        after = end
        for i, value in enumerate(outputs):
            with graph.inserting_after(after):
                after = graph.call_function(operator.getitem, (end, i))
            for user in users[value]:
                user.replace_input_with(value, after)
    if nvtx:
        for node in list(graph.nodes):
            name = _moec_packet_name(node)
            if name is None:
                continue
            with graph.inserting_before(node):
                graph.call_function(nvtx_push, (name,))
            with graph.inserting_after(node):
                graph.call_function(nvtx_pop, ())
    graph.lint()
    return fx.GraphModule(gm, graph)


# --- the window --------------------------------------------------------------------------------


class StepProfiler:
    """Profiles the steps of ``window`` of a training loop around ``compiled`` (a
    :class:`~moec.runtime.compiled.CompiledModel`)::

        profiler = StepProfiler(window, compiled, run_dir / "profile", rank=rank, device=device)
        while step < steps:
            with profiler.step(step):
                train_step()

    The window opens before step ``window.start`` and closes (writing its files) after step
    ``window.stop - 1``, or when a step inside it raises. ``say`` prints the summary."""

    def __init__(
        self,
        window: ProfileWindow,
        compiled: Any,
        out: Path | str,
        *,
        rank: int = 0,
        device: torch.device | str = "cpu",
        with_stack: bool = False,
        row_limit: int = 25,
        say: Callable[[str], None] | None = print,
    ):
        self.window, self.compiled = window, compiled
        self.out = Path(out)
        self.rank = rank
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.with_stack, self.row_limit, self.say = with_stack, row_limit, say
        self.profiler: torch.profiler.profile | None = None
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        return self.profiler is not None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run step ``step`` inside this context."""
        if step == self.window.start and not self.written:
            self._open()
        if not self.active:
            yield
            return
        try:
            with torch.autograd.profiler.record_function(f"step {step}"):
                if self.cuda:
                    torch.cuda.nvtx.range_push(f"step {step}")
                try:
                    yield
                finally:
                    if self.cuda:
                        torch.cuda.nvtx.range_pop()
        except BaseException:
            self.close()
            raise
        if step + 1 >= self.window.stop:
            self.close()

    def _open(self) -> None:
        program = self.compiled.program
        if program is None:
            raise ProfileError("the profile window opens before the model's first call")
        blocks = block_paths(program)
        # the instrumented copy is made now, outside the traced steps
        self.compiled.set_instrument(functools.partial(instrument, blocks=blocks, nvtx=self.cuda))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            # at the window's edge, not in a step: earlier steps' kernels stay out of the capture
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.start()
        self.profiler = torch.profiler.profile(
            activities=activities, record_shapes=True, with_stack=self.with_stack
        )
        self.profiler.start()

    def close(self) -> list[Path]:
        """Close the window if open (writing the trace and summary); the files written."""
        if self.profiler is None:
            return self.written
        profiler, self.profiler = self.profiler, None
        self.compiled.set_instrument(None)
        if self.cuda:  # after the window's last step: its kernels end inside the capture
            torch.cuda.synchronize(self.device)
        profiler.stop()
        if self.cuda:
            torch.cuda.profiler.stop()
        run_files.real_folder(self.out)  # written as every run file is: never through a link
        trace = self.out / f"trace_rank{self.rank}.json"
        with run_files.replacing(trace) as partial:
            profiler.export_chrome_trace(str(partial))
        summary = self.summary(profiler, trace)
        path = self.out / f"summary_rank{self.rank}.txt"
        run_files.write_text(path, summary)
        ops = self.out / f"ops_rank{self.rank}.json"
        run_files.write_text(ops, json.dumps(self.ops_summary(trace), indent=1) + "\n")
        self.written = [trace, path, ops]
        if self.say is not None:
            self.say(summary)
        return self.written

    def summary(self, profiler: torch.profiler.profile, trace: Path) -> str:
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=self.row_limit)
        w = self.window
        head = (
            f"profile of steps {w.start}..{w.stop - 1} (rank {self.rank}, {self.device}); "
            f"trace: {trace}\n\nops by {sort.replace('_', ' ')}:\n"
        )
        return head + table + "\n" + format_block_totals(block_totals(trace), self.cuda) + "\n"

    def ops_summary(self, trace: Path) -> dict[str, Any]:
        """The window's ops for calibration (see module): ``samples`` (GEMM and attention
        :class:`~moec.analysis.cost.time.OpSample` s), ``other_s`` and ``comm_s`` (device
        seconds of the rest and of collectives), ``ops`` (per op, kind and input shapes: calls
        and seconds), ``busy_s`` and ``span_s`` (the kernels' time without overlaps, and from
        the first one's start to the last one's end), and what the memory fit needs:
        ``forward_calls`` (the model's forward passes in the window), ``microbatch`` (its
        [batch, seq]), ``steps``, ``world``."""
        from moec.analysis.cost.time import read_trace

        read = read_trace(trace)
        program = self.compiled.program
        cost = graph_cost(program)
        sizes = cost.sizes()
        dims = [cost.dims.get(d) for d in ("batch", "seq")]
        microbatch = [int(sizes.get(d, d)) for d in dims] if None not in dims else None
        totals = block_totals(trace)
        first = next((n for n in totals if not n.endswith(BACKWARD_SUFFIX)), None)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return {
            "device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
            "device_time": read.device_time,
            "rank": self.rank,
            "world": world,
            "steps": self.window.steps,
            "forward_calls": int(totals[first]["calls"]) if first else self.window.steps,
            "microbatch": microbatch,
            "pipeline": program.pipeline is not None,
            "other_s": read.other_s,
            "comm_s": read.comm_s,
            "busy_s": read.busy_s,
            "span_s": read.span_s,
            "samples": [dataclasses.asdict(s) for s in read.samples],
            "ops": read.ops,
        }


def block_totals(trace: Path | str) -> dict[str, dict[str, float]]:
    """Per block range name in a Chrome trace: calls and summed CPU span (``cpu_us``) and, where
    the trace has them (CUDA), GPU span (``gpu_us``) of its ranges, in microseconds."""
    events = json.loads(Path(trace).read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    totals: dict[str, dict[str, float]] = {}
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or not name.startswith(BLOCK_PREFIX):
            continue
        key = {"user_annotation": "cpu_us", "gpu_user_annotation": "gpu_us"}.get(event.get("cat"))
        if key is None:
            continue
        row = totals.setdefault(name, {"calls": 0, "cpu_us": 0.0, "gpu_us": 0.0})
        row[key] += float(event.get("dur", 0.0))
        if key == "cpu_us":
            row["calls"] += 1
    return totals


def format_block_totals(totals: dict[str, dict[str, float]], gpu: bool) -> str:
    """The per-block table: one row per block range, each block's backward after its forward,
    blocks in the order their ranges first appear."""
    if not totals:
        return "per-block totals: no block ranges in the trace"
    width = max(len(n) for n in totals)
    cols = ["calls", "CPU ms"] + (["GPU ms"] if gpu else [])
    lines = ["per-block totals (summed spans of the block ranges):"]
    lines.append(f"{'range':<{width}}  " + "  ".join(f"{c:>10}" for c in cols))
    blocks = list(dict.fromkeys(n.removesuffix(BACKWARD_SUFFIX) for n in totals))

    def order(name: str) -> tuple[int, bool]:
        return blocks.index(name.removesuffix(BACKWARD_SUFFIX)), name.endswith(BACKWARD_SUFFIX)

    for name in sorted(totals, key=order):
        row = totals[name]
        cells = [f"{int(row['calls']):>10}", f"{row['cpu_us'] / 1e3:>10.3f}"]
        if gpu:
            cells.append(f"{row['gpu_us'] / 1e3:>10.3f}")
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)
