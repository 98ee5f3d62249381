"""The device benchmarks as one named suite: ``python -m benchmarks.suite [NAME ...]``.

Every entry names the commands it runs and the section of ``benchmarks/RESULTS.md`` its
output feeds; ``--list`` prints them, ``--dry-run`` prints the commands without running them.
Entries run in the order given (a group name, e.g. ``kernels``, stands for its entries). A
failing command is logged and the next entry still runs; each command is stopped after
``--limit`` seconds, so a hung collective cannot eat a device session. Everything an entry
writes goes under ``--out``: ``NAME.log`` (its commands' output), the JSON its commands
write, ``device.txt`` (GPU, driver, commit) and ``clocks.csv`` (SM clock, power and
temperature every 200 ms; summarised at the end over the busy samples, since the H200 and
H100 run at their power cap and slow steps come with clock dips).

Entries of kind ``setup`` install what a machine without network access needs, from files
carried beside the working tree (``.whl/``, ``.whl-parts/``, ``.wpa/``, ``.wpb/``, ``.tao/``,
``.qcache/``; ``../shared/tools/device-wheels`` prepares them); they run nothing measured.

Contract: the suite imports nothing heavy (no torch) until a command runs, so ``--list`` and
``--dry-run`` work anywhere. Commands run from the repository root with ``PYTHONPATH`` set to
it and NVLink multicast off (it can take a shared host's GPUs out of service).
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

ROOT = Path(__file__).resolve().parents[1]
Launcher = Literal["python", "module", "torchrun", "pytest"]

# NVLink multicast stays off: it can take a shared host's GPUs out of service
BASE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
AUTOTUNED = (("MOEC_AUTOTUNE", "1"),)  # how every benchmark row since session 12 was measured
UNTUNED = (("MOEC_AUTOTUNE", "0"),)  # the GPU tests: first configs, shorter compiles


@dataclass(frozen=True)
class Command:
    """One process: ``launcher`` runs ``target`` with ``args``.

    ``python``: ``target`` is a script path; ``module``: a module run with ``-m``;
    ``torchrun``: a script run on ``ranks`` processes of this host; ``pytest``: ``target`` is
    the test path (globs allowed). ``{out}`` and ``{gpus}`` in ``args`` and ``ranks`` are the
    output folder and this machine's GPU count."""

    launcher: Launcher
    target: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = AUTOTUNED
    ranks: str = "{gpus}"

    def argv(self, out: Path | str, gpus: int | str) -> list[str]:
        """The command line, placeholders filled and test globs expanded."""
        args = [a.format(out=out, gpus=gpus) for a in self.args]
        if self.launcher == "python":
            return [sys.executable, self.target, *args]
        if self.launcher == "module":
            return [sys.executable, "-m", self.target, *args]
        if self.launcher == "torchrun":
            ranks = self.ranks.format(gpus=gpus)
            return ["torchrun", "--standalone", "--nproc-per-node", ranks, self.target, *args]
        tests = sorted(glob.glob(self.target, root_dir=ROOT)) or [self.target]
        return [sys.executable, "-m", "pytest", *args, *tests]


@dataclass(frozen=True)
class Entry:
    """A named benchmark: what it measures, the RESULTS.md section it feeds, its commands.

    ``gpus`` is the fewest GPUs it needs (0: runs on a CPU); ``action`` replaces the
    commands for the ``setup`` entries."""

    name: str
    what: str
    section: str
    commands: tuple[Command, ...] = ()
    gpus: int = 1
    kind: Literal["benchmark", "tests", "setup"] = "benchmark"
    action: Callable[[Path, TextIO], None] | None = field(default=None, compare=False)


def _py(script: str, args: str = "") -> Command:
    """``python SCRIPT ARGS`` (``args`` split as a shell would), autotuned."""
    return Command("python", script, tuple(shlex.split(args)))


def _mod(module: str, args: str = "") -> Command:
    """``python -m MODULE ARGS``, autotuned."""
    return Command("module", module, tuple(shlex.split(args)))


def _run(script: str, args: str = "", ranks: str = "{gpus}") -> Command:
    """``torchrun`` of SCRIPT on ``ranks`` processes (default: every GPU), autotuned."""
    return Command("torchrun", script, tuple(shlex.split(args)), AUTOTUNED, ranks)


def _tests(path: str) -> Command:
    """The GPU tests at ``path``, slow ones included, no ``-x``, autotuning off; ``-v`` names
    each result as it comes, so a command stopped at its limit still says which failed."""
    return Command("pytest", path, ("-v", "-rfE", "--slow"), UNTUNED)


def _setup(name: str, what: str, action: Callable[[Path, TextIO], None]) -> Entry:
    return Entry(name, what, "-", kind="setup", gpus=0, action=action)


# --- setup: files the device tool carried, installed without network --------------------------

WHEEL_PARTS = Path.home() / "wheelparts"


def _quack_cache() -> Path:
    return Path(os.environ.get("QUACK_CACHE_DIR", Path.home() / "quack_cache"))


def _gather_wheel_parts(out: Path, log: TextIO) -> None:
    """Copy the split wheel's parts carried in ``.whl-parts/``, ``.wpa/``, ``.wpb/`` to
    ``~/wheelparts`` (one device call carries at most 64 MiB, so a large wheel comes in two
    back-to-back calls) and restore a quack cache carried in ``.qcache/``."""
    WHEEL_PARTS.mkdir(exist_ok=True)
    for folder in (".whl-parts", ".wpa", ".wpb"):
        for part in sorted((ROOT / folder).glob("*")):
            shutil.copy2(part, WHEEL_PARTS / part.name)
            print("carried", part.name, file=log, flush=True)
    cache = ROOT / ".qcache" / "quack_cache.tgz"
    if cache.is_file():
        _quack_cache().mkdir(parents=True, exist_ok=True)
        with tarfile.open(cache) as tar:
            tar.extractall(_quack_cache(), filter="data")
        print("quack cache restored to", _quack_cache(), file=log, flush=True)


def _install_wheels(out: Path, log: TextIO) -> None:
    """Join the wheel parts, install them and ``.whl/*.whl`` (torchao apart) into this
    interpreter, then check that the CuTe DSL and quack import."""
    _gather_wheel_parts(out, log)
    wheels = []
    for name in sorted({p.name.rsplit(".part.", 1)[0] for p in WHEEL_PARTS.glob("*.part.*")}):
        whole = Path("/tmp") / name
        with whole.open("wb") as dst:
            for part in sorted(WHEEL_PARTS.glob(f"{name}.part.*")):
                dst.write(part.read_bytes())
        wheels.append(str(whole))
    wheels += [str(w) for w in sorted((ROOT / ".whl").glob("*.whl")) if "torchao" not in w.name]
    _pip_install(wheels, log)
    _check_import("import cutlass, quack; print('quack', quack.__version__, cutlass.__file__)", log)


def _install_torchao(out: Path, log: TextIO) -> None:
    """Install torchao's wheel carried in ``.tao/`` (the float8 baselines' anchor)."""
    _pip_install([str(w) for w in sorted((ROOT / ".tao").glob("*.whl"))], log)
    _check_import("import torchao; print('torchao', torchao.__version__)", log)


def _save_quack_cache(out: Path, log: TextIO) -> None:
    """Write the quack cache to ``OUT/quack_cache.tgz``: a later call that carries it in
    ``.qcache/`` starts warm (30 s for the e2e model's first step instead of 175 s)."""
    with tarfile.open(out / "quack_cache.tgz", "w:gz") as tar:
        tar.add(_quack_cache(), arcname=".")
    print("quack cache written to", out / "quack_cache.tgz", file=log, flush=True)


def _pip_install(wheels: list[str], log: TextIO) -> None:
    """Install ``wheels`` into this interpreter (a bare ``pip`` may be another one's)."""
    if not wheels:
        raise FileNotFoundError("no wheel carried: see ../shared/tools/device-wheels")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels]
    subprocess.run(pip, check=True, stdout=log, stderr=subprocess.STDOUT)


def _check_import(code: str, log: TextIO) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, stdout=log, stderr=subprocess.STDOUT)


# --- the suite ---------------------------------------------------------------------------------

E2E = "benchmarks/e2e.py"
SCALING = "benchmarks/scaling.py"
SINGLE = "--single {out}/e2e_single.json"  # one GPU's step, the scaling runs' reference
E = Entry

ENTRIES: tuple[Entry, ...] = (
    _setup("wheel-part", "carry a split wheel's first part; restore a carried quack cache",
           _gather_wheel_parts),
    _setup("wheels", "install quack-kernels, the CuTe DSL and FA4 from carried wheels",
           _install_wheels),
    _setup("torchao", "install torchao from .tao/ (the float8 baselines)", _install_torchao),
    _setup("quack-cache", "save quack's compile cache to OUT/quack_cache.tgz", _save_quack_cache),
    E("gpu-tests-1", "GPU tests, files a-g (attention, combined, FP8, gathered, ...)",
      "GPU tests", (_tests("tests/gpu/test_[a-g]*.py"),), kind="tests"),
    E("gpu-tests-2", "GPU tests: the kernels and ops against their references", "GPU tests",
      (_tests("tests/gpu/test_kernels_ops.py"),), kind="tests"),
    E("gpu-tests-3", "GPU tests, files l-z (MXFP8, recompute, graphs, sync-free, 2 GPUs)",
      "GPU tests", (_tests("tests/gpu/test_[l-z]*.py"),), kind="tests"),
    E("e2e", "the e2e step (FP8 dense FFNs; SDPA beside the default attention) against "
      "issue #20's baseline, 20 timed steps", "e2e training step",
      (_py(E2E, "--steps 20 --warmup 4 --fp8 --attention sdpa --baselines compiled-fp32 "
           "--json {out}/e2e.json"),)),
    E("e2e-baselines", "the e2e step beside every compiled baseline (run `torchao` first)",
      "e2e training step",
      (_py(E2E, "--steps 8 --warmup 4 --fp8 --baselines compiled-fp32 compiled-fp32-float8 "
           "compiled-bf16 compiled-bf16-float8 --json {out}/e2e_baselines.json"),)),
    E("first-step", "seconds to the first step: the e2e workload launched twice in fresh "
      "processes on one cache (cold, then warm), with its breakdown and the per-block "
      "compiled MoE as an anchor", "first step",
      (_py("benchmarks/first_step.py", "--anchors --json {out}/first_step.json"),)),
    E("tune-table", "autotune the e2e workload's kernels and write this GPU's entries of "
      "the shipped tile table", "first step",
      (_py("benchmarks/tune_table.py", "--table {out}/tuning.json"),)),
    E("e2e-recompute", "the e2e step with block recompute beside the default", "recompute",
      (_py(E2E, "--moec-only --recompute --steps 4 --warmup 2 "
           "--json {out}/e2e_recompute.json"),)),
    E("profile", "the FP8 step's kernels by kind and the device's idle time, beside the "
      "baseline", "step profile",
      (_mod("benchmarks.profile_step", "--baseline compiled-fp32 --fp8 dense_ffn --rows 5 "
            "--gaps 25 --steps 3"),)),
    E("profile-kernels", "the FP8 step's largest kernels of each kind", "step profile",
      (_mod("benchmarks.profile_step", "--moec-only --fp8 dense_ffn --rows 5 --kernels 5"),)),
    E("layer", "the MoE layer, forward + backward, beside sort + torch._grouped_mm",
      "MoE layer",
      (_py("benchmarks/moe_layer.py", "--skip-loop --kernels 12 --json {out}/layer.json"),)),
    E("gemm", "the grouped GEMMs by backend at the Table-48 shape", "grouped GEMM",
      (_py("benchmarks/grouped_gemm.py", "--m 1024 4096 32768 131072 "
           "--json {out}/grouped_gemm.json"),)),
    E("movement", "dispatch / combine kernels against torch's index ops", "movement kernels",
      (_mod("benchmarks.movement", "--json {out}/movement.json"),)),
    E("precision", "FP8 rowwise and MXFP8 grouped GEMMs against bf16", "precision GEMMs",
      (_py("benchmarks/precision_gemm.py", "--out {out}/precision_gemm.json"),)),
    E("recompute", "each recompute policy: step time, activation memory against the "
      "prediction", "recompute",
      (_mod("benchmarks.recompute", "--full --steps 4 --out {out}/recompute_full.json"),)),
    E("memory", "per-rank memory: the model's prediction against the measured peak",
      "per-rank memory", (_mod("benchmarks.memory", "--steps 3 --json {out}/memory.json"),)),
    E("dense-ffn", "a dense gated FFN: cuBLAS + GLU, compiled, one k-major expert, FP8, "
      "torchao float8", "dense FFN",
      (_py("benchmarks/dense_ffn.py", "--json {out}/dense_ffn.json"),)),
    E("lm-head", "the LM head's loss by chunk size, fused or not, beside torch.compile",
      "LM head", (_py("benchmarks/lm_head.py", "--json {out}/lm_head.json"),)),
    E("cross-entropy", "the LM-head loss's cross-entropy kernel", "cross-entropy kernel",
      (_py("benchmarks/cross_entropy.py", "--json {out}/cross_entropy.json"),)),
    E("row-quantizer", "the FP8 row quantizer on the e2e model's rows", "FP8 row quantizer",
      (_py("benchmarks/row_quantizer.py", "--json {out}/row_quantizer.json"),)),
    E("glu", "the GLU kernels forward and backward beside torch.compile", "GLU",
      (_py("benchmarks/glu.py", "--json {out}/glu.json"),)),
    E("attention", "FA4 against SDPA's backends at the e2e shape", "attention",
      (_py("benchmarks/attention.py", "--json {out}/attention.json"),)),
    E("fuse-linears", "q, k, v as one GEMM against three", "fused linears",
      (_py("benchmarks/fuse_linears.py", "--json {out}/fuse_linears.json"),)),
    E("quack-layouts", "quack's expert GEMMs by operand layout", "quack layouts",
      (_py("benchmarks/quack_layouts.py", "--json {out}/quack_layouts.json"),)),
    E("quality", "parity, upcycling and balancing on a corpus of moec's sources (the GPU "
      "scale where a GPU is)", "quality",
      (_mod("moec", "data build {out}/corpus --source moec --force"),
       *(_mod("benchmarks.quality", f"{x} --corpus {{out}}/corpus --out {{out}}/quality --jobs 2")
         for x in ("parity", "upcycle", "balance")))),
    E("table49", "the plan search on the report's Table 49 models (on paper)", "Table 49",
      (_mod("benchmarks.autoplan_table49", "--json {out}/autoplan_table49.json"),), gpus=0),
    E("capture", "moec.compile's capture and passes on a 2-layer Qwen3.5, split into "
      "torch.export, passes, verification and fake propagation (CPU)", "capture and passes (CPU)",
      (_py("benchmarks/capture_profile.py", "--json {out}/capture_profile.json"),), gpus=0),
    E("materialize", "FreshInit materialization of the e2e workload's program (2 B "
      "parameters), on the GPU where there is one", "materialize",
      (_py("benchmarks/materialize.py", "--json {out}/materialize.json"),)),
    E("program-cache", "the e2e program compiled in fresh processes on one cache: the passes "
      "run, then the program loaded", "program cache",
      (_py("benchmarks/program_cache.py", "--json {out}/program_cache.json"),)),
    E("plan-search", "the plan search's top plans and the example plans that fit, predicted "
      "against measured, on every GPU", "plan search",
      (_run("benchmarks/autoplan_validate.py", "--json {out}/autoplan.json"),)),
    E("ep", "the EP layer by transport, and the dp = ep step", "expert parallelism",
      (_run("benchmarks/ep.py", "--json {out}/ep.json"),), gpus=2),
    E("ep-overlap", "the EP layer whole, in halves and with two-batch overlap",
      "expert parallelism",
      (_run("benchmarks/ep.py", "--overlap --paths rowwise,a2a_capacity --iters 20 --steps 5 "
            "--kernels 8 --json {out}/ep_overlap.json"),), gpus=2),
    E("scaling", "the EP and PP steps over every GPU against one GPU's step", "scaling",
      (_py(E2E, "--moec-only --json {out}/e2e_single.json"),
       _run(SCALING, f"--ep {{gpus}} --path rowwise {SINGLE} --json {{out}}/scaling_ep.json"),
       _run(SCALING, f"--pp {{gpus}} --microbatches 16 {SINGLE} "
            "--json {out}/scaling_pp.json")), gpus=2),
    E("timeline", "where the EP step's time goes, one GPU's step beside it", "scaling",
      (_run(SCALING, "--ep {gpus} --path rowwise --timeline {out}/tl --kernels {out}/k "
            "--json {out}/ep_timeline.json"),
       _run(SCALING, "--timeline {out}/tl1 --kernels {out}/k1", ranks="1"),
       _mod("benchmarks.timeline_diff", "{out}/tl_pp1_mb4_rank0.json "
            "{out}/tl1_pp1_mb4_rank0.json")), gpus=2),
    E("collectives", "NCCL collectives at a step's message sizes", "collectives",
      (_run("benchmarks/collectives.py", "--json {out}/collectives.json"),), gpus=2),
    E("scale", "sharded programs: upcycling past one GPU; DDP + EP against FSDP + EP",
      "sharded programs",
      (_run("benchmarks/scale.py", "upcycle --json {out}/scale_upcycle.json"),
       _run("benchmarks/scale.py", "ddp-vs-fsdp --json {out}/scale_ddp_fsdp.json")), gpus=2),
)  # fmt: skip

GROUPS: dict[str, tuple[str, ...]] = {
    "gpu-tests": ("gpu-tests-1", "gpu-tests-2", "gpu-tests-3"),
    "kernels": (
        "gemm",
        "layer",
        "movement",
        "precision",
        "dense-ffn",
        "lm-head",
        "cross-entropy",
        "row-quantizer",
        "glu",
        "attention",
    ),
    "step": ("e2e", "e2e-baselines", "profile", "profile-kernels", "e2e-recompute", "first-step"),
    "multi-gpu": ("ep", "ep-overlap", "scaling", "timeline", "collectives", "scale", "plan-search"),
}
BY_NAME = {e.name: e for e in ENTRIES}


def resolve(names: Sequence[str]) -> list[Entry]:
    """The entries ``names`` asks for, in order, groups expanded; an unknown name raises
    ValueError naming it and what ``--list`` offers."""
    entries = []
    for name in names:
        for member in GROUPS.get(name, (name,)):
            if member not in BY_NAME:
                known = ", ".join([*BY_NAME, *GROUPS])
                raise ValueError(f"unknown suite entry {name!r}; known: {known}")
            entries.append(BY_NAME[member])
    return entries


def listing() -> str:
    """Every entry (name, GPUs, section, what it measures, its commands) and every group."""
    lines = []
    for kind in ("setup", "tests", "benchmark"):
        lines.append(f"{kind}:")
        for e in (e for e in ENTRIES if e.kind == kind):
            section = "" if e.section == "-" else f"  [RESULTS.md: {e.section}]"
            lines.append(
                f"  {e.name:16} {e.gpus} GPU{'s' if e.gpus != 1 else ' '}  {e.what}{section}"
            )
            lines += ["      " + shown(c.argv("OUT", "GPUS")) for c in e.commands]
    lines.append("groups:")
    lines += [f"  {g:16} {' '.join(members)}" for g, members in GROUPS.items()]
    return "\n".join(lines)


def shown(argv: list[str]) -> str:
    """A command line as a reader would type it."""
    return " ".join("python" if a == sys.executable else a for a in argv)


def gpu_count() -> int:
    """GPUs on this machine, by ``nvidia-smi -L`` (0 where it is missing)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def run_entry(entry: Entry, out: Path, gpus: int, limit: int) -> int:
    """Run ``entry``'s commands into ``OUT/NAME.log``; stop at the first failing one and return
    its exit status (124: past ``limit`` seconds)."""
    env = {
        **os.environ,
        **BASE_ENV,
        "PYTHONPATH": str(ROOT),
        "QUACK_CACHE_DIR": str(_quack_cache()),
    }
    with (out / f"{entry.name}.log").open("w") as log:
        if entry.action is not None:
            try:
                entry.action(out, log)
            except (OSError, subprocess.CalledProcessError) as error:
                print(f"{entry.name}: {error}", file=log)
                return 1
            return 0
        for command in entry.commands:
            argv = command.argv(out, gpus)
            print("$", shown(argv), file=log, flush=True)
            rc = run_process(argv, {**env, **dict(command.env)}, log, limit)
            if rc:
                return rc
    return 0


def run_process(argv: list[str], env: dict[str, str], log: TextIO, limit: int) -> int:
    """Run ``argv`` from the root, output to ``log``; past ``limit`` seconds its whole process
    group (torchrun's workers too) is stopped and 124 returned."""
    with subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    ) as process:
        try:
            return process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
                os.killpg(process.pid, sig)
                try:
                    process.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            print(f"stopped after {limit} s", file=log, flush=True)
            return 124


def start_clocks(out: Path) -> subprocess.Popen | None:
    """Sample each GPU's SM clock, power and temperature every 200 ms into ``clocks.csv``."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "--query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu"
    with (out / "clocks.csv").open("w") as csv:
        return subprocess.Popen(
            ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "200"],
            stdout=csv,
            stderr=subprocess.DEVNULL,
        )


def clock_summary(csv: Path) -> str:
    """The SM clock range and the peak power over the samples drawn above 300 W (steps, not
    compiles), or '' where none were."""
    busy = []
    for line in csv.read_text().splitlines() if csv.is_file() else ():
        fields = [f.strip() for f in line.split(",")]
        try:
            clock, power = float(fields[2]), float(fields[3])
        except (IndexError, ValueError):
            continue
        if power > 300:
            busy.append((clock, power))
    if not busy:
        return ""
    clocks = [c for c, _ in busy]
    return (
        f"SM clock while busy (> 300 W) {min(clocks):.0f}-{max(clocks):.0f} MHz, power up "
        f"to {max(p for _, p in busy):.0f} W ({len(busy)} samples)"
    )


def describe_device(out: Path) -> None:
    """Write the GPUs, driver and commit to ``device.txt`` and print them."""
    lines = []
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        lines.append(subprocess.run(query, capture_output=True, text=True).stdout.strip())
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    lines.append(head.stdout.strip() or "no git commit")
    (out / "device.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def pack(out: Path) -> Path:
    """Everything under ``out`` as one ``results.tgz`` (for a device tool that brings back
    few files); the packed files are removed."""
    archive = out.parent / f"{out.name}_results.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=".")
    shutil.rmtree(out)
    out.mkdir()
    return Path(shutil.move(archive, out / "results.tgz"))


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="entries or groups to run")
    parser.add_argument("--list", action="store_true", help="the entries and groups, then exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT", "/tmp/moec_out"),
        help="the output folder (default: $OUT or /tmp/moec_out)",
    )
    parser.add_argument("--limit", type=int, default=540, help="seconds per command")
    parser.add_argument("--gpus", type=int, default=None, help="default: nvidia-smi's count")
    parser.add_argument(
        "--pack", action="store_true", help="pack the outputs into OUT/results.tgz at the end"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    if args.list or not args.names:
        print(listing())
        return 0
    try:
        entries = resolve(args.names)
    except ValueError as error:
        parser.error(str(error))
    out = Path(args.out).resolve()
    gpus = gpu_count() if args.gpus is None else args.gpus
    if args.dry_run:
        for e in entries:
            print(f"# {e.name}", *(shown(c.argv(out, gpus)) for c in e.commands), sep="\n")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    describe_device(out)
    clocks = start_clocks(out)
    failed = 0
    try:
        for entry in entries:
            if gpus < entry.gpus:
                print(f"== {entry.name} skipped: needs {entry.gpus} GPUs, this machine has {gpus}")
                continue
            start = time.monotonic()
            rc = run_entry(entry, out, gpus, args.limit)
            failed += rc != 0
            print(f"== {entry.name} rc={rc} {time.monotonic() - start:.0f}s", flush=True)
            print("".join((out / f"{entry.name}.log").read_text().splitlines(True)[-25:]))
    finally:
        if clocks is not None:
            clocks.terminate()
    print(clock_summary(out / "clocks.csv"))
    if args.pack:
        print("results in", pack(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
