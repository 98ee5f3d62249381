"""``write_repro(program, plan, args, kwargs, out_dir, title)``: a script that reruns a program.

Writes::

    out_dir/repro.py          the program's readable code (``print_readable``: one class, its
                              sub-graphs such as recompute regions as nested classes) with its
                              imports, and a ``main`` that builds it with random parameters (each
                              parameter's shape, dtype, mean and std), runs one forward + backward
                              on random inputs of the example's shapes and dtypes, and prints the
                              loss
    out_dir/repro_state.pt    the buffers and tensor constants the program reads (RoPE tables,
                              masks), and the example inputs it does not draw (neither integer
                              nor floating point)

``python3 repro.py [DEVICE]`` (default ``cpu``) needs torch and moec (for the ``moec::`` ops).
Integer inputs are drawn between the example's minimum and maximum (token ids stay in the
vocabulary); working-weight copies are rewritten from the random parameters, so the program
computes with its parameters' values; under a bf16 plan the forward runs in bf16 autocast as
:class:`moec.CompiledModel` runs it. The loss is the program's first output when that is a
scalar (a model captured with its loss, as ``moec debug`` does by default), else the mean
square of that output. Expert-parallel programs need their process group and are not written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph_module import _format_import_block
from torch.package import sys_importer

from moec.plan import Plan
from moec.program import Program

SCRIPT = '''\
"""moec repro: {title}

pipeline: {pipeline}

The final program with random parameters, the buffers in repro_state.pt, one forward + backward
on random inputs of the captured shapes. Run: python3 repro.py [DEVICE]   (default: cpu)
"""

import sys
from pathlib import Path

import torch

import moec.ops  # noqa: F401  (registers the moec:: ops)
{imports}

{code}

PROGRAM = {root}
REGIONS = {regions}
"""sub-graph attribute -> its class. print_readable nests the class in its owner's class; it is
taken off there, so that the attribute reads the sub-graph module placed on the instance"""
for path in sorted(REGIONS, key=len, reverse=True):
    *owner, name = path.split(".")
    owner_class = PROGRAM
    for part in owner:
        owner_class = getattr(owner_class, part)
    delattr(owner_class, name)
PARAMETERS = {parameters}
"""name -> (shape, dtype, mean, std)"""
TIED = {tied}
"""another name of a parameter -> its name in PARAMETERS"""
INPUTS = {inputs}
"""the flat inputs: ("randint", shape, dtype, low, high), ("randn", shape, dtype),
("saved", index into repro_state.pt's inputs) or ("value", python value)"""
WORKING_COPIES = {working_copies}
"""bf16 copy buffer -> the parameters whose rows it holds"""
AUTOCAST = {autocast}


def place(root, name, value):
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        root.register_buffer(leaf, value)
    else:
        setattr(root, leaf, value)


def build(state, device):
    program = PROGRAM()
    for name, region in REGIONS.items():
        place(program, name, region())
    for name, (shape, dtype, mean, std) in PARAMETERS.items():
        value = torch.randn(shape).mul(std).add(mean).to(dtype)
        place(program, name, torch.nn.Parameter(value))
    for alias, name in TIED.items():
        place(program, alias, program.get_parameter(name))
    for name, tensor in state["buffers"].items():
        place(program, name, tensor)
    program.to(device)
    with torch.no_grad():
        for buffer, names in WORKING_COPIES.items():
            rows = torch.cat([program.get_parameter(n) for n in names])
            program.get_buffer(buffer).copy_(rows)
    return program


def make_input(spec, state, device):
    kind, *rest = spec
    if kind == "randint":
        shape, dtype, low, high = rest
        return torch.randint(low, high + 1, shape, dtype=dtype, device=device)
    if kind == "randn":
        shape, dtype = rest
        return torch.randn(shape, dtype=dtype, device=device)
    if kind == "saved":
        return state["inputs"][rest[0]].to(device)
    return rest[0]


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    torch.manual_seed(0)
    state = torch.load(Path(__file__).with_name("repro_state.pt"), weights_only=True)
    program = build(state, device)
    inputs = [make_input(spec, state, device) for spec in INPUTS]
    device_type = torch.device(device).type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=AUTOCAST):
        outputs = program(*inputs)
    first = outputs[0]
    loss = first if first.dim() == 0 else first.float().square().mean()
    loss.backward()
    with_grads = sum(p.grad is not None for p in program.parameters())
    print(f"loss {{loss.item():.6f}}")
    print(f"{{with_grads}} of {{len(PARAMETERS)}} parameters have gradients")


if __name__ == "__main__":
    main()
'''


def write_repro(
    program: Program, plan: Plan, args: tuple, kwargs: dict, out_dir: Path, title: str
) -> Path:
    """Write ``repro.py`` and ``repro_state.pt`` for ``program`` (compiled under ``plan`` from
    the example ``(args, kwargs)``) into ``out_dir``; the script's path."""
    gm = program.graph
    flat = program.signature.flatten_inputs(args, kwargs)
    buffers = _tensor_attributes(gm)
    saved = [x for x in flat if _drawn_as(x) == "saved"]
    specs = [_input_spec(x, saved) for x in flat]
    modules = {name: m for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)}
    root = gm._get_name()
    text = SCRIPT.format(
        title=title,
        pipeline=program.pass_pipeline,
        imports=_imports(modules.values()),
        code=gm.print_readable(print_output=False),
        root=root,
        regions="{" + ", ".join(f"{name!r}: {root}.{name}" for name in modules if name) + "}",
        # reprs are source: numbers, strings, tuples, dicts and dtypes (``torch.float32``)
        parameters=repr(
            {name: (tuple(p.shape), p.dtype, *_moments(p)) for name, p in gm.named_parameters()}
        ),
        tied=repr(_tied(gm)),
        inputs=repr(specs),
        working_copies=repr(program.working_weights),
        autocast=plan.precision.compute_dtype == "bf16",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"buffers": buffers, "inputs": saved}, out_dir / "repro_state.pt")
    script = out_dir / "repro.py"
    script.write_text(text)
    return script


def _imports(modules: Any) -> str:
    """The import lines every graph's code needs (each graph's globals, as fx pickling does)."""
    lines: set[str] = set()
    for module in modules:
        code = module.graph.python_code(root_module="self")
        lines.update(_format_import_block(code.globals, sys_importer).splitlines())
    return "\n".join(sorted(lines - {"import torch"}))  # the script imports torch already


def _tensor_attributes(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor the graphs read with ``get_attr`` that is not a parameter, by its path from
    ``gm``: buffers and tensor constants, detached to plain CPU tensors."""
    params = {id(p) for p in gm.parameters()}
    found: dict[str, torch.Tensor] = {}
    for prefix, module in gm.named_modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.find_nodes(op="get_attr"):
            value = _resolve(module, node.target)
            if isinstance(value, torch.Tensor) and id(value) not in params:
                path = f"{prefix}.{node.target}" if prefix else node.target
                found[path] = value.detach().cpu().clone()
    return found


def _resolve(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _tied(gm: fx.GraphModule) -> dict[str, str]:
    """Every further name of a parameter reachable under several -> its first name."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            tied[name] = first[id(p)]
    return tied


def _moments(p: torch.Tensor) -> tuple[float, float]:
    values = p.detach().float()
    return round(values.mean().item(), 6), round(values.std(unbiased=False).item(), 6)


def _drawn_as(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return "value"
    if x.dtype.is_floating_point:
        return "randn"
    return "saved" if x.dtype == torch.bool or x.is_complex() else "randint"


def _input_spec(x: Any, saved: list[torch.Tensor]) -> tuple:
    kind = _drawn_as(x)
    if kind == "value":
        return (kind, x)
    if kind == "saved":
        return (kind, next(i for i, s in enumerate(saved) if s is x))
    if kind == "randn":
        return (kind, tuple(x.shape), x.dtype)
    return (kind, tuple(x.shape), x.dtype, int(x.min()), int(x.max()))
