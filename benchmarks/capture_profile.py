"""Where ``moec.compile`` spends its time before lowering: capture and passes on a HF model (CPU).

Compiles a tiny transformers model (default: a 2-layer Qwen3.5, one Gated DeltaNet layer and
one full-attention layer, hidden 256) to an MoE program with ``lowering.inductor`` off, so the
time is capture and passes only, and splits it into:

- ``export``: ``torch.export.export`` itself (torch's share of the capture);
- ``capture_rest``: the rest of :func:`moec.frontend.capture` (inlining export's region ops,
  fixed sizes, the flat calling convention);
- ``passes``: the passes' own ``run`` (each pass's ``seconds`` statistic), by pass;
- ``verification``: the verifier after capture and after each pass
  (:mod:`moec.passes.verify`), with its fake-tensor propagation (``propagation``) counted
  apart, and the nodes propagation ran;
- ``other``: the compile's remaining time (pass selection, the program, the runtime wrapper).

The same compile's ``capture_s`` and ``passes_s`` as ``moec train``'s first-step clock
(:class:`moec.train.timing.FirstStepClock`, from :data:`moec.compiler.phase_seconds`) reports
them are printed too: its ``passes_s`` holds the verification.

Wall and CPU (``time.process_time``) seconds are both printed: the machine may be shared.
``--cprofile FILE`` also writes a cProfile of the compile and prints its top functions.
Measurement only; no GPU needed.

    python benchmarks/capture_profile.py [--family qwen3_5] [--seq 16] [--batch 2]
        [--hidden 256] [--layers 2] [--experts 8] [--top-k 2] [--no-verify]
        [--cprofile FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FAMILIES = ("qwen3_5", "qwen3", "llama")
"""Tiny transformers models this script builds (:func:`build_model`)."""


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_5")
    parser.add_argument("--seq", type=int, default=16, help="example sequence length")
    parser.add_argument("--batch", type=int, default=2, help="example batch size")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--experts", type=int, default=8, help="moe.num_experts")
    parser.add_argument("--top-k", type=int, default=2, help="moe.top_k")
    parser.add_argument("--no-verify", action="store_true", help="compile with verify=False")
    parser.add_argument("--cprofile", type=Path, help="write a cProfile of the compile here")
    parser.add_argument("--json", type=Path, help="write the breakdown here")
    return parser


def build_model(family: str, hidden: int, layers: int) -> Any:
    """A randomly initialized causal LM of ``family``: vocabulary 256, ``layers`` layers of
    width ``hidden``, FFN ``2 * hidden``; Qwen3.5 alternates Gated DeltaNet and full attention
    (every fourth layer full, as the family's default, and the last one full)."""
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if family == "qwen3_5":
        kinds = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ]
        kinds[-1] = "full_attention"
        config = tf.Qwen3_5TextConfig(
            **common,
            layer_types=kinds,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=hidden // 8,
            linear_value_head_dim=hidden // 8,
        )
        return tf.Qwen3_5ForCausalLM(config)
    names = {"qwen3": "Qwen3", "llama": "Llama"}[family]
    return getattr(tf, f"{names}ForCausalLM")(getattr(tf, f"{names}Config")(**common))


class Clock:
    """Wall and CPU seconds and calls of named parts, from wrapped functions."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, float]] = {}

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.timing(part):
                return fn(*args, **kwargs)

        return timed

    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        entry = self.parts.setdefault(part, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0})
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            entry["wall_s"] += time.perf_counter() - wall
            entry["cpu_s"] += time.process_time() - cpu
            entry["calls"] += 1


@contextlib.contextmanager
def instrumented(clock: Clock, nodes_run: list[int]) -> Iterator[None]:
    """Time torch.export, the capture, the verifier and fake propagation while compiling
    (module attributes wrapped for the block, restored after)."""
    import torch

    import moec.compiler
    import moec.passes.manager
    import moec.passes.verify

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def propagate(*args: Any, **kwargs: Any) -> Any:
            ran = fn(*args, **kwargs)
            nodes_run.append(len(ran) if isinstance(ran, list) else -1)
            return ran

        return propagate

    patches = [
        (torch.export, "export", clock.wrap("export", torch.export.export)),
        (moec.compiler, "capture", clock.wrap("capture", moec.compiler.capture)),
        (
            moec.passes.manager,
            "verify_graph",
            clock.wrap("verification", moec.passes.manager.verify_graph),
        ),
        (
            moec.passes.manager,
            "verify_program",
            clock.wrap("verification", moec.passes.manager.verify_program),
        ),
        (
            moec.passes.verify,
            "propagate_fake",
            clock.wrap("propagation", counted(moec.passes.verify.propagate_fake)),
        ),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, fn in patches:
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Compile the model once under the clocks; the breakdown (see module)."""
    import torch

    import moec
    from moec.compiler import phase_seconds

    torch.manual_seed(0)
    model = build_model(args.family, args.hidden, args.layers)
    ids = torch.randint(0, 256, (args.batch, args.seq))
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        model(input_ids=ids)
    dense = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
    plan = {
        "moe": {"num_experts": args.experts, "top_k": args.top_k},
        "lowering": {"inductor": False},
    }
    clock, nodes_run = Clock(), []
    phases_before = dict(phase_seconds)
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
    with instrumented(clock, nodes_run), clock.timing("compile"):
        if profiler is not None:
            profiler.enable()
        compiled = moec.compile(model, plan, (), {"input_ids": ids}, verify=not args.no_verify)
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        profiler.dump_stats(args.cprofile)
    passes = {name: r.stats.get("seconds", 0.0) for name, r in compiled.pass_results.items()}
    phases = {f"{p}_s": phase_seconds[p] - phases_before[p] for p in ("capture", "passes")}
    return {
        "family": args.family,
        "shape": {"batch": args.batch, "seq": args.seq, "hidden": args.hidden},
        "layers": args.layers,
        "verify": not args.no_verify,
        "nodes": len(compiled.graph_module.graph.nodes),
        "dense_forward": dense,
        "parts": clock.parts,
        "passes_s": passes,
        "phases": phases,
        "propagation_nodes_run": nodes_run,
    }


def report(result: dict[str, Any]) -> str:
    """The breakdown as lines: each part's wall and CPU seconds, and the rest."""
    parts = result["parts"]
    zero = {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0}
    total, capture = parts["compile"], parts.get("capture", zero)
    export, verify = parts.get("export", zero), parts.get("verification", zero)
    prop = parts.get("propagation", zero)
    passes = sum(result["passes_s"].values())

    def line(name: str, wall: float, cpu: float | None = None, note: str = "") -> str:
        cpu_text = "" if cpu is None else f"  cpu {cpu:7.2f} s"
        return f"  {name:<28} {wall:7.2f} s{cpu_text}  {note}".rstrip()

    shape = result["shape"]
    lines = [
        f"{result['family']}, {result['layers']} layers, hidden {shape['hidden']}, "
        f"batch {shape['batch']} x seq {shape['seq']}: {result['nodes']} nodes after the "
        f"passes; dense forward {result['dense_forward']['wall_s']:.2f} s",
        line("compile (total)", total["wall_s"], total["cpu_s"]),
        line("torch.export", export["wall_s"], export["cpu_s"]),
        line(
            "capture, moec's rest",
            capture["wall_s"] - export["wall_s"],
            capture["cpu_s"] - export["cpu_s"],
        ),
        line(
            "passes (run)",
            passes,
            None,
            ", ".join(f"{n} {s:.2f}" for n, s in result["passes_s"].items()),
        ),
        line(
            "verification",
            verify["wall_s"],
            verify["cpu_s"],
            f"({int(verify['calls'])} checks)",
        ),
        line(
            "  of which fake propagation",
            prop["wall_s"],
            prop["cpu_s"],
            f"(nodes run per propagation: {result['propagation_nodes_run']})",
        ),
        line(
            "other",
            total["wall_s"] - capture["wall_s"] - passes - verify["wall_s"],
        ),
        "  as moec train's first-step clock splits it (moec.train.timing): "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["phases"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    result = measure(args)
    print(report(result))
    if args.cprofile:
        import pstats

        pstats.Stats(str(args.cprofile)).sort_stats("cumulative").print_stats(25)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
