"""Ahead-of-time build of the CuTe DSL MXFP8 grouped GEMMs for Blackwell, without a GPU.

The CuTe DSL (nvidia-cutlass-dsl) compiles on a CPU-only machine: kernels are traced against
fake tensors, and its compiler library (which embeds NVVM and the PTX assembler) lowers them to
PTX and a cubin for the arch named by ``CUTE_DSL_ARCH``. This module builds quack-kernels'
block-scaled grouped GEMM (MXFP8: e4m3 operands, E8M0 scales over blocks of 32 along K, the
sm100 tcgen05 kernel class) for sm_100a (B200) and sm_103a (B300), in the two grouped forms an
MoE layer uses:

- ``varlen_m``: ``out[r] = a[r] @ b[e(r)]^T`` over rows grouped by cumulative offsets, both
  operands K-major, bf16 out (forward and dgrad);
- ``varlen_k``: ``out[g] = a_g @ b_g^T`` over the rows of group g (the weight gradient), A
  M-major and B N-major, fp32 out;

each at the tile configs quack's ``blockscaled_default_config`` picks (128x128 on one CTA,
256x128 and 256x256 on a CTA pair). The check reads the PTX: it targets the arch and every
``tcgen05.mma`` is the block-scaled ``kind::mxf8f6f4 ... block32`` form, on a CTA pair where the
config asks for one; the cubin must be an ELF image.

The DSL reads its target arch from the environment once per process, so each arch compiles in
a worker process of its own (``--worker``), and the arches run concurrently. The kernels are
compiled through ``quack.gemm._compile_gemm`` -- the call ``quack.gemm.gemm`` makes, with the
device capability passed in instead of read from a GPU -- which is private to quack, so the
build pins quack-kernels 0.6.5 on nvidia-cutlass-dsl 4.8.1 (:data:`INSTALL`).

    python -m moec.kernels.cute_build 100 103    # one line per arch; exit 1 on a failed kernel,
                                                 # 2 when the DSL or quack is not installed
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ARCHS = {100: "sm_100a", 103: "sm_103a"}
"""Capabilities this build accepts -> the DSL's arch name (``a``: arch-specific tcgen05)."""

REQUIRED = ("cutlass", "quack")
"""Top-level modules the build imports (nvidia-cutlass-dsl, quack-kernels)."""

INSTALL = "pip install nvidia-cutlass-dsl==4.8.1 quack-kernels==0.6.5"
"""What to install when :data:`REQUIRED` is missing."""

MISSING_EXIT = 2
"""Exit status when the CuTe DSL or quack cannot be imported."""

_RESULT_TAG = "CUTE_BUILD_RESULT "  # prefixes the worker's one JSON line on stdout
_WORKER_TIMEOUT_S = 900


@dataclass(frozen=True)
class Variant:
    """One kernel: the grouped form and the tile config (quack's GemmConfig fields)."""

    varlen: Literal["m", "k"]
    tile_m: int
    tile_n: int
    cluster_m: int
    cluster_n: int
    pingpong: bool
    dynamic_persistent: bool

    @property
    def name(self) -> str:
        pair = "_2cta" if self.two_cta else ""
        return f"mxfp8_gmm_varlen_{self.varlen}_{self.tile_m}x{self.tile_n}{pair}"

    @property
    def two_cta(self) -> bool:
        """Whether quack's sm100 class runs this tile on a CTA pair (``cta_group::2``)."""
        # Mirrors quack.gemm_config.cta_tile_shape_m for block-scaled tiles.
        return self.cluster_m % 2 == 0 and self.tile_m == 256


@dataclass(frozen=True)
class KernelBuild:
    """The outcome of one variant on one arch: ``problem`` is None when it built as expected."""

    name: str
    problem: str | None
    mma: tuple[str, ...] = ()
    seconds: float = 0.0


@dataclass(frozen=True)
class ArchBuild:
    """Every variant built for one arch, or ``error`` when the worker could not run them."""

    capability: int
    kernels: tuple[KernelBuild, ...]
    error: str | None = None
    missing: bool = False  # the worker could not import REQUIRED
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and all(k.problem is None for k in self.kernels)

    def line(self) -> str:
        """One line for the CLI: ok and a summary, or FAIL and what went wrong first."""
        arch = ARCHS[self.capability]
        if self.error is not None:
            return f"FAIL {arch} {self.error}"
        bad = [k for k in self.kernels if k.problem is not None]
        if bad:
            first = bad[0]
            more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
            return f"FAIL {arch} {first.name}: {first.problem}{more}"
        forms = sorted({m for k in self.kernels for m in k.mma})
        names = ", ".join(k.name.removeprefix("mxfp8_gmm_") for k in self.kernels)
        return (
            f"ok   {arch} {len(self.kernels)} MXFP8 grouped GEMMs ({names}): "
            f"tcgen05.mma {' / '.join(f.removeprefix('tcgen05.mma.') for f in forms)} "
            f"({self.seconds:.1f} s)"
        )


def missing() -> list[str]:
    """The modules of :data:`REQUIRED` that are not installed (found without importing)."""
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def check_build(
    variant: Variant, capability: int, ptx: str | None, cubin: bytes | None
) -> str | None:
    """None if the PTX and cubin are the arch's block-scaled MXFP8 GEMM, else what is wrong."""
    arch = ARCHS[capability]
    if not ptx:
        return "the DSL returned no PTX"
    if f".target {arch}" not in ptx:
        return f"PTX does not target {arch}"
    mma = [line.strip() for line in ptx.splitlines() if "tcgen05.mma" in line]
    if not mma:
        return "no tcgen05.mma in the PTX"
    for needle in ("kind::mxf8f6f4", "block_scale", "block32"):
        if not all(needle in line for line in mma):
            return f"a tcgen05.mma without {needle}: {next(s for s in mma if needle not in s)}"
    group = "cta_group::2" if variant.two_cta else "cta_group::1"
    if not all(group in line for line in mma):
        return f"expected {group} MMAs for a {variant.tile_m}-row tile on {variant.cluster_m} CTAs"
    if not cubin or not bytes(cubin).startswith(b"\x7fELF"):
        return "the DSL returned no cubin (ELF image)"
    return None


def _mma_forms(ptx: str) -> tuple[str, ...]:
    """The distinct tcgen05.mma opcodes in the PTX (opcode only, no operands)."""
    return tuple(sorted({
        line.split()[0] for line in (s.strip() for s in ptx.splitlines())
        if line.startswith("tcgen05.mma")
    }))  # fmt: skip


def _variants() -> list[Variant]:
    """Both grouped forms at every tile config quack's block-scaled default picks on sm100."""
    from quack.gemm_config import blockscaled_default_config

    # (m, n) pairs reaching each branch of blockscaled_default_config: small, 256x128, 256x256
    configs = {
        blockscaled_default_config(m, n, 10) for m, n in ((128, 128), (512, 128), (512, 256))
    }
    ordered = sorted(configs, key=lambda c: (c.tile_m, c.tile_n))
    return [
        Variant(varlen, c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, c.pingpong,
                c.is_dynamic_persistent)
        for varlen in ("m", "k") for c in ordered
    ]  # fmt: skip


def _compile(variant: Variant, capability: int, dump: Path) -> tuple[str | None, bytes | None]:
    """PTX and cubin of ``variant``, as the DSL writes them to ``dump`` (its dump dir).

    The process's ``CUTE_DSL_ARCH`` must name ``capability``. The DSL names its files after a
    truncated signature, so two variants can share a name: ``dump`` is emptied first, and a
    file the compile did not write is never read.
    """
    from cutlass import BFloat16, Float8E4M3FN, Float8E8M0FNU, Float32
    from quack.gemm import _compile_gemm
    from quack.rounding import RoundingMode

    varlen_m = variant.varlen == "m"
    # varlen_m wants K-major A and B; varlen_k (the wgrad) wants M-major A and N-major B
    a_major, b_major = ("k", "k") if varlen_m else ("m", "n")
    _compile_gemm(
        Float8E4M3FN, Float8E4M3FN, BFloat16 if varlen_m else Float32, None,  # a, b, d, c dtypes
        a_major, b_major, "n", None,
        (variant.tile_m, variant.tile_n), (variant.cluster_m, variant.cluster_n, 1),
        variant.pingpong, True, variant.dynamic_persistent,  # persistent
        None, None, 0,  # no row/col vector epilogue operands
        0, 0, False, None,  # alpha, beta modes; add_to_output; concat_layout
        varlen_m, not varlen_m, False, False, False,  # varlen_m, varlen_k; no gather, no permute
        (capability // 10, capability % 10), RoundingMode.RN, 0, None,
        sf_dtype=Float8E8M0FNU, sf_vec_size=32,
        a_mma_dtype=Float8E4M3FN, b_mma_dtype=Float8E4M3FN,
    )  # fmt: skip
    ptx, cubin = sorted(dump.glob("*.ptx")), sorted(dump.glob("*.cubin"))
    if len(ptx) > 1 or len(cubin) > 1:
        raise RuntimeError(f"expected one PTX and one cubin in {dump}, found {ptx + cubin}")
    return (ptx[0].read_text() if ptx else None), (cubin[0].read_bytes() if cubin else None)


def _worker(capability: int) -> int:
    """Build every variant in this process and print the result as one tagged JSON line."""
    try:
        import cutlass  # noqa: F401
        import quack  # noqa: F401
    except ImportError as err:
        print(f"cannot import the CuTe DSL or quack: {err}", file=sys.stderr)
        return MISSING_EXIT
    dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    kernels = []
    for variant in _variants():
        start = time.perf_counter()
        try:
            dump.mkdir(parents=True, exist_ok=True)
            for old in dump.iterdir():
                old.unlink()
            ptx, cubin = _compile(variant, capability, dump)
            problem = check_build(variant, capability, ptx, cubin)
            forms = _mma_forms(ptx or "")
        except Exception as err:  # report every kernel, then fail
            problem, forms = f"{type(err).__name__}: {err}".splitlines()[0], ()
        seconds = time.perf_counter() - start
        kernels.append({"name": variant.name, "problem": problem, "mma": forms, "seconds": seconds})
    print(_RESULT_TAG + json.dumps(kernels), flush=True)
    return 0


def _worker_env(capability: int, dump_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    # moec importable in the worker however the parent found it (checkout or install)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["CUTE_DSL_ARCH"] = ARCHS[capability]
    env["CUTE_DSL_KEEP"] = "ptx,cubin"  # the DSL writes both to its dump dir
    env["CUTE_DSL_DUMP_DIR"] = dump_dir  # a temporary dir the parent deletes
    env["QUACK_CACHE_ENABLED"] = "0"  # a cached .o would load without PTX
    return env


def build(capabilities: list[int]) -> list[ArchBuild]:
    """Build every variant for each capability, one worker process per arch, concurrently."""
    unknown = [c for c in capabilities if c not in ARCHS]
    if unknown:
        raise ValueError(
            f"no tcgen05 block-scaled MMA build for capability {unknown}; accepted: {list(ARCHS)}"
        )
    with tempfile.TemporaryDirectory(prefix="moec-cute-build-") as dump:
        procs = {}
        for cap in capabilities:
            cmd = [sys.executable, "-m", "moec.kernels.cute_build", "--worker", str(cap)]
            env = _worker_env(cap, os.path.join(dump, ARCHS[cap]))
            procs[cap] = (time.perf_counter(), subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ))  # fmt: skip
        return [_collect(cap, start, proc) for cap, (start, proc) in procs.items()]


def _collect(capability: int, start: float, proc: subprocess.Popen) -> ArchBuild:
    try:
        out, err = proc.communicate(timeout=_WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return ArchBuild(capability, (), f"worker timed out after {_WORKER_TIMEOUT_S} s")
    seconds = time.perf_counter() - start
    tail = (err.strip().splitlines() or [f"worker exited {proc.returncode}"])[-1]
    if proc.returncode == MISSING_EXIT:
        return ArchBuild(capability, (), f"{tail}; install: {INSTALL}", missing=True)
    lines = [line for line in out.splitlines() if line.startswith(_RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        return ArchBuild(capability, (), f"worker exited {proc.returncode}: {tail}")
    kernels = tuple(
        KernelBuild(k["name"], k["problem"], tuple(k["mma"]), k["seconds"])
        for k in json.loads(lines[-1].removeprefix(_RESULT_TAG))
    )
    return ArchBuild(capability, kernels, seconds=seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capabilities", type=int, nargs="+", help="of 100 (B200), 103 (B300)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [c for c in args.capabilities if c not in ARCHS]
    if unknown:
        parser.error(f"capability {unknown}: no tcgen05 block-scaled MMA; accepted: {list(ARCHS)}")
    if args.worker:
        if len(args.capabilities) != 1:
            parser.error("--worker builds exactly one capability")
        return _worker(args.capabilities[0])
    absent = missing()
    if absent:
        print(f"cute_build: {', '.join(absent)} not installed; install: {INSTALL}",
              file=sys.stderr)  # fmt: skip
        return MISSING_EXIT
    results = build(args.capabilities)
    for result in results:
        print(result.line(), flush=True)
    if any(r.missing for r in results):
        return MISSING_EXIT
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
