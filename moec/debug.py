"""Debug dumps of the graph after every pass: the ``PassManager(dump=...)`` hook.

``DebugDump(out_dir, plan)`` writes, for the captured graph and after every pass::

    out_dir/pipeline.txt            the plan's pipeline string and the resolved plan as YAML
    out_dir/summary.txt             one stats line per stage
    out_dir/NN_<stage>/graph.py     readable code of the GraphModule (pipeline string on top)
    out_dir/NN_<stage>/ops.txt      op table: node, op, target, shape/dtype, module, from_pass
    out_dir/NN_<stage>/graph.dot    Graphviz text (``dot -Tsvg graph.dot``); pass-made nodes shaded
    out_dir/NN_<stage>/diff.patch   unified diff of graph.py against the previous stage (a comment
                                    line when the pass changed nothing)
    out_dir/NN_<stage>/stats.json   nodes, parameters, active parameters, FLOPs/token, pass stats
    out_dir/bindings.txt            after pass ``bind``: the target, the grouped-GEMM policy and
                                    each ``moec::`` node's bound implementation (also printed)
    out_dir/lowering.txt            after the compile: how Inductor compiles the program, per
                                    block (which blocks share a graph) or whole and why (also
                                    printed; :mod:`moec.runtime.block_graphs`)

and, after the compile, ``dump.write_repro(compiled, args, kwargs)`` adds ``out_dir/repro.py``:
the final program as a standalone script with random weights (see :mod:`moec.repro`); where the
plan lowers to Inductor on the inputs' device (``plan.lowering.inductor``: ``auto`` on CUDA, or
``true``), ``dump.write_lowered(compiled, args, kwargs)`` adds
``out_dir/lowered/``: Inductor's trace of one step (``output_code.py`` per compiled graph).

With ``print_after_all=True`` (``moec debug --print-after-all``) the code, op table, diff and
stats line go to the terminal (rich) instead of files. Writers never raise: a failure is logged
and the dump goes on, so debugging output can never break a compile.

``moec debug`` compiles what ``moec train`` runs: the model with its next-token loss
(:func:`with_next_token_loss`), so the loss passes (``fused_loss``) show; ``--no-loss`` dumps
the bare model.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from moec.analysis.cost import format_count, graph_cost
from moec.errors import MoecError
from moec.fx import module_path, parameter_count
from moec.kernels.gemm_backend import policy_text
from moec.passes.manager import pipeline_string
from moec.plan import Plan
from moec.program import Program
from moec.repro import write_repro
from moec.runtime.lowering import device_type

log = logging.getLogger(__name__)

OP_COLUMNS = ("node", "op", "target", "shape/dtype", "module", "from_pass")
DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


class DebugDump:
    """A dump hook ``hook(stage_name, program, stats)`` writing the files listed in the module
    doc."""

    def __init__(
        self,
        out_dir: str | Path | None,
        plan: Plan,
        *,
        pass_pipeline: str | None = None,
        print_after_all: bool = False,
        console: Console | None = None,
    ):
        """``pass_pipeline``: the pass-pipeline string of the passes that will run (default:
        the plan's pipeline)."""
        if out_dir is None and not print_after_all:
            raise ValueError("DebugDump needs an output directory unless print_after_all is set")
        self.out = None if out_dir is None else Path(out_dir)
        self.plan, self.print_after_all = plan, print_after_all
        self.pass_pipeline = pass_pipeline or pipeline_string(plan)
        self.console = console or Console()
        self.stages: list[str] = []
        self.summaries: list[str] = []
        self._previous: tuple[str, str] = ("empty", "")
        self._safely("pipeline.txt", self._start)

    def __call__(self, stage: str, program: Program, stats: dict[str, Any]) -> None:
        gm = program.graph
        name = f"{len(self.stages):02d}_{stage}"
        self.stages.append(name)
        code = self._safely("graph.py", lambda: readable_code(gm, self.pass_pipeline)) or ""
        ops = self._safely("ops", lambda: op_rows(gm)) or []
        diff = unified_diff(self._previous, (name, code))
        self._previous = (name, code)
        record = self._safely("stats", lambda: stage_stats(stage, program, stats)) or {
            "stage": stage
        }
        record["pipeline"] = self.pass_pipeline
        line = summary_line(record)
        self.summaries.append(line)
        if self.print_after_all:
            self._safely("terminal", lambda: self._print(name, code, ops, diff, line))
            if stage == "bind":
                text = self._safely("bindings", lambda: bindings_text(program)) or ""
                self.console.print(text, markup=False, highlight=False, soft_wrap=True)
            return
        files: dict[str, Callable[[], str]] = {
            "graph.py": lambda: code,
            "ops.txt": lambda: format_op_table(ops),
            "graph.dot": lambda: graphviz_dot(gm, name),
            "diff.patch": lambda: diff or f"# {name}: the graph did not change\n",
            "stats.json": lambda: json.dumps(record, indent=2, default=str) + "\n",
        }
        tables = stat_tables(stats)
        if tables:
            files["tables.txt"] = lambda: tables
        for filename, text in files.items():
            self._safely(f"{name}/{filename}", lambda t=text, f=filename: self._write(name, f, t()))
        self._safely("summary.txt", lambda: self._append_summary(line))
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        if stage == "bind":
            text = self._safely("bindings", lambda: bindings_text(program)) or ""
            self._safely("bindings.txt", lambda: (self.out / "bindings.txt").write_text(text))
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def write_repro(self, compiled: Any, args: tuple, kwargs: dict, title: str) -> Path | None:
        """``out_dir/repro.py`` (and its ``repro_state.pt``) for ``compiled``'s final program,
        captured from the example ``(args, kwargs)``; None when there is no output directory or
        the writer failed (logged)."""
        if self.out is None:
            return None
        return self._safely(
            "repro.py",
            lambda: write_repro(compiled.program, self.plan, args, kwargs, self.out, title),
        )

    def write_lowering(self, compiled: Any, args: tuple) -> str | None:
        """How Inductor compiles ``compiled``'s program, per block or whole and why
        (:meth:`~moec.runtime.compiled.CompiledModel.lowering_layout`), prefixed by whether the
        plan lowers it on the inputs' device; printed, and written to ``out_dir/lowering.txt``.
        None when the writer failed (logged)."""

        def text() -> str:
            device = device_type(args)
            layout = compiled.lowering_layout()
            if self.plan.lowers_to_inductor(device):
                return f"lowering: {layout}"
            return f"lowering: off on {device} (the program runs eagerly); where on, {layout}"

        layout = self._safely("lowering", text)
        if layout is not None:
            self.console.print(layout, markup=False, highlight=False, soft_wrap=True)
            if self.out is not None:
                self._safely("lowering.txt", lambda: (self.out / "lowering.txt").write_text(layout))
        return layout

    def write_lowered(self, compiled: Any, args: tuple, kwargs: dict) -> Path | None:
        """Where the plan lowers to Inductor on the inputs' device: ``out_dir/lowered/``,
        Inductor's trace of one forward and backward of ``compiled`` on the example inputs (per
        compiled graph: the FX graph it was given, its IR before and after fusion, and
        ``output_code.py``, the generated program); None without an output directory, without
        the lowering, or when the step failed (logged)."""
        if self.out is None or not self.plan.lowers_to_inductor(device_type(args)):
            return None
        return self._safely("lowered", lambda: self._trace_lowered(compiled, args, kwargs))

    def _trace_lowered(self, compiled: Any, args: tuple, kwargs: dict) -> Path:
        import torch._inductor.config as inductor_config

        out = self.out / "lowered"
        trace = {"trace.enabled": True, "trace.debug_dir": str(out), "fx_graph_cache": False}
        with inductor_config.patch(trace):
            result = compiled(*args, **kwargs)
            loss = result if isinstance(result, torch.Tensor) else result[0]
            if loss.requires_grad:
                loss.float().sum().backward()
        compiled.zero_grad(set_to_none=True)
        return out

    # --- output ------------------------------------------------------------------------------

    def _start(self) -> None:
        text = f"{self.pass_pipeline}\n\n{self.plan.to_yaml()}"
        if self.print_after_all:
            self.console.rule("pipeline")
            self.console.print(text, markup=False, highlight=False)
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "pipeline.txt").write_text(text)
        (self.out / "summary.txt").write_text("")

    def _write(self, stage_dir: str, filename: str, text: str) -> None:
        path = self.out / stage_dir / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def _append_summary(self, line: str) -> None:
        with open(self.out / "summary.txt", "a") as f:
            f.write(line + "\n")

    def _print(
        self, name: str, code: str, ops: list[tuple[str, ...]], diff: str, line: str
    ) -> None:
        self.console.rule(f"after {name}")
        self.console.print(Syntax(code, "python", line_numbers=False))
        table = Table(*OP_COLUMNS, title=f"ops after {name}")
        for row in ops:
            table.add_row(*row)
        self.console.print(table)
        if diff:
            self.console.print(Syntax(diff, "diff"))
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _safely(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # debug output must never break a compile
            log.warning("moec debug: could not produce %s: %s: %s", what, type(exc).__name__, exc)
            return None


# --- the pieces, usable on their own -----------------------------------------------------------


class DebugInputError(MoecError):
    """The model's example inputs do not fit what ``moec debug`` compiles."""


def with_next_token_loss(
    model: torch.nn.Module, args: tuple, kwargs: dict, spec: str
) -> tuple[torch.nn.Module, tuple]:
    """What ``moec train`` compiles for ``model``: ``LanguageModelWithLoss(model)`` on the
    example ``(tokens, targets)``, the targets being the tokens shifted by one (ids the model
    accepts). ``model`` (named ``spec``) must take one integer token tensor."""
    from moec.train import LanguageModelWithLoss

    tokens = args[0] if len(args) == 1 and not kwargs else None
    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dim() != 2:
        given = [describe_value(a) or type(a).__name__ for a in args] + sorted(kwargs)
        raise DebugInputError(
            f"moec debug: {spec}'s example inputs are {given}; the next-token loss that "
            "moec train adds needs one integer token tensor [batch, seq]. Pass --no-loss to "
            "dump the bare model"
        )
    return LanguageModelWithLoss(model), (tokens, tokens.roll(-1, dims=1))


def readable_code(gm: fx.GraphModule, pass_pipeline: str | None = None) -> str:
    header = f"# moec passes: {pass_pipeline}\n" if pass_pipeline is not None else ""
    return header + gm.print_readable(print_output=False)


def describe_value(val: Any) -> str:
    """``f32[s0, s1, 128]`` for a tensor, a tuple of those, ``sym s0`` for a SymInt."""
    if isinstance(val, torch.Tensor):
        dtype = DTYPE_NAMES.get(val.dtype, str(val.dtype).removeprefix("torch."))
        return f"{dtype}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_value(v) for v in val) + ")"
    if isinstance(val, (torch.SymInt, int, float)):
        return f"sym {val}"
    return ""


def _target_name(node: fx.Node) -> str:
    if node.op == "call_function":
        target = node.target
        if hasattr(target, "_schema"):
            return str(target)
        return getattr(target, "__name__", str(target))
    return str(node.target) if node.op in ("get_attr", "call_module", "call_method") else ""


def op_rows(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    return [
        (
            node.name,
            node.op,
            _target_name(node),
            describe_value(node.meta.get("val")),
            module_path(node),
            str(node.meta.get("from_pass", "")),
        )
        for node in gm.graph.nodes
    ]


def format_op_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [OP_COLUMNS, *rows]) for i in range(len(OP_COLUMNS))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [OP_COLUMNS, tuple("-" * w for w in widths), *rows]
    ]
    return "\n".join(lines) + "\n"


def unified_diff(before: tuple[str, str], after: tuple[str, str]) -> str:
    """Unified diff of two (stage name, graph.py text) pairs."""
    return "".join(
        difflib.unified_diff(
            before[1].splitlines(keepends=True),
            after[1].splitlines(keepends=True),
            fromfile=f"{before[0]}/graph.py",
            tofile=f"{after[0]}/graph.py",
        )
    )


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


DOT_FILL = {"placeholder": "lightblue", "get_attr": "lightyellow", "output": "lightgrey"}


def graphviz_dot(gm: fx.GraphModule, name: str = "graph") -> str:
    """The graph as Graphviz text; nodes a pass created are orange."""
    lines = [f'digraph "{_dot_escape(name)}" {{', "  node [shape=box, fontsize=10, style=filled];"]
    for node in gm.graph.nodes:
        label = "\\n".join(
            _dot_escape(part)
            for part in (node.name, _target_name(node), describe_value(node.meta.get("val")))
            if part
        )
        fill = "orange" if node.meta.get("from_pass") else DOT_FILL.get(node.op, "white")
        lines.append(f'  "{_dot_escape(node.name)}" [label="{label}", fillcolor="{fill}"];')
        for source in node.all_input_nodes:
            lines.append(f'  "{_dot_escape(source.name)}" -> "{_dot_escape(node.name)}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def bindings_text(program: Program) -> str:
    """What pass ``bind`` bound: the target, its grouped-GEMM policy, and one line per
    ``moec::`` node (``node  op: impl (what it is)``)."""
    target = program.target
    if target is None:
        return "bindings: none (pass bind did not run)\n"
    kernels = target.triton and target.device == "cuda" and target.gemm not in ("reference", "loop")
    lines = [
        f"target: {target.describe()}",
        policy_text(target.arch, target.gemm_policy() if kernels else None),
    ]
    lines.append(f"bound implementations ({len(program.bindings)} moec:: nodes):")
    width = max((len(name) for name in program.bindings), default=0)
    lines += [f"  {name.ljust(width)}  {what}" for name, what in program.bindings.items()]
    return "\n".join(lines) + "\n"


def stage_stats(stage: str, program: Program, pass_stats: dict[str, Any]) -> dict[str, Any]:
    """The numbers behind the stats line; cost numbers at the example input sizes."""
    gm = program.graph
    record: dict[str, Any] = {
        "stage": stage,
        "nodes": len(gm.graph.nodes),
        "pass_stats": dict(pass_stats),
    }
    try:
        report = graph_cost(program).evaluate()
    except Exception as exc:
        log.warning("moec debug: no cost model for %s: %s", stage, exc)
        record["params"] = parameter_count(gm)
        record["cost_error"] = f"{type(exc).__name__}: {exc}"
        return record
    record.update(
        params=report.params,
        active_params=report.active_params,
        tokens=report.tokens,
        sizes=report.sizes,
        flops_per_token=report.flops_per_token,
        train_flops_per_token=report.train_flops_per_token,
        saved_bytes=report.saved_bytes,
        blocks=report.blocks,
    )
    return record


def summary_line(record: dict[str, Any]) -> str:
    parts = [f"[{record['stage']}]", f"nodes={record.get('nodes', '?')}"]
    if "params" in record:
        parts.append(f"params={format_count(record['params'])}")
    if "active_params" in record:
        parts.append(f"active={format_count(record['active_params'])}")
    if "flops_per_token" in record:
        parts.append(f"fwd_flops/token={format_count(record['flops_per_token'])}")
        parts.append(f"train_flops/token={format_count(record['train_flops_per_token'])}")
    stats = record.get("pass_stats") or {}
    parts += [f"{k}={v}" for k, v in stats.items() if not isinstance(v, (list, dict))]
    return " ".join(parts)


def stat_tables(stats: dict[str, Any]) -> str:
    """Pass statistics that are tables (lists of rows, e.g. recompute's ``memory_table`` or the
    pipeline's stage costs) as aligned text; '' when there are none."""
    out = []
    for name, rows in stats.items():
        if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
            continue
        columns = list(dict.fromkeys(k for r in rows for k in r))
        cells = [[_cell(r.get(c)) for c in columns] for r in rows]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
        out.append(f"{name}:")
        out.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
        out.append("")
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return format_count(value)
    return str(value)
