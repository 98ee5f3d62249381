"""GPU specifications as data, for the time and memory models of :mod:`moec.autoplan`.

:class:`GPUSpec` holds what a plan search needs of one GPU: memory, dense peak TFLOP/s in BF16,
FP8 and MXFP8, HBM bandwidth, NVLink bandwidth per GPU (one direction) and the inter-node
bandwidth per GPU (one direction; a parameter of the cluster, not of the chip). :data:`GPUS`
holds the datasheet values of H100, H200, B200 and B300 (SXM parts, dense = without 2:4
sparsity) and, where moec measured them, the ceilings of the device (``measured``):

    spec = gpu_spec("h200")                          # datasheet + measured ceilings
    spec = gpu_spec("b300", inter_node_gbps=100)     # one 800 Gb/s rail per GPU
    spec = gpu_spec("h200", probe="probe.json")      # values measured on this machine

A probe file is a JSON object of any :class:`GPUSpec` field (``{"bf16_tflops": 770, ...}``);
:func:`probe_gpu` writes one by measuring the current CUDA device (a dense bf16 GEMM, a device
copy, and a bf16 all-to-all-sized peer copy when a second GPU is visible).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from moec.errors import MoecError

GIB = 1024**3
MIB = 1024**2


class GPUSpecError(MoecError, ValueError):
    """An unknown GPU name or a probe file that is not a JSON object of GPUSpec fields."""


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU: datasheet values, and the ceilings measured on such a device where known."""

    name: str
    memory_bytes: int
    bf16_tflops: float
    """Dense BF16 tensor-core peak; the MFU basis (Table 51: H100/H200 989, B200/B300 2250)."""
    fp8_tflops: float
    """Dense FP8 (per-tensor / rowwise scaled) peak."""
    mxfp8_tflops: float | None
    """Dense MXFP8 (block-scaled) peak; None where the MMA has no block scaling (sm90: moec
    emulates it, slower than bf16, so the search does not offer it there)."""
    hbm_gbps: float
    """HBM bandwidth, GB/s (1e9 bytes/s)."""
    nvlink_gbps: float
    """NVLink bandwidth per GPU, one direction, GB/s."""
    inter_node_gbps: float
    """Network bandwidth per GPU, one direction, GB/s (a cluster parameter)."""
    gpus_per_node: int = 8
    arch: str = "sm90"
    measured: tuple[tuple[str, float, str], ...] = ()
    """(field, value, where it was measured): ceilings that replace ``datasheet x DERATE``."""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def peak_tflops(self, gemm: str) -> float:
        """Datasheet dense peak of a GEMM precision (``bf16``, ``fp8_rowwise``, ``mxfp8``)."""
        if gemm == "bf16":
            return self.bf16_tflops
        if gemm == "fp8_rowwise":
            return self.fp8_tflops
        if gemm == "mxfp8":
            if self.mxfp8_tflops is None:
                raise GPUSpecError(f"{self.name} has no native MXFP8 MMA (sm90): use fp8_rowwise")
            return self.mxfp8_tflops
        raise GPUSpecError(f"unknown GEMM precision {gemm!r}: bf16, fp8_rowwise or mxfp8")

    def ceiling(self, what: str) -> float:
        """The attainable rate of ``what`` (a rate field: ``bf16_tflops``, ``fp8_tflops``,
        ``mxfp8_tflops``, ``hbm_gbps``, ``nvlink_gbps``, ``inter_node_gbps``): the measured
        value if any, else the datasheet's times :data:`DERATE`. A low-precision peak without
        its own measurement scales with the measured bf16 ceiling."""
        measured = {f: v for f, v, _ in self.measured}
        if what in measured:
            return measured[what]
        if what in ("fp8_tflops", "mxfp8_tflops") and "bf16_tflops" in measured:
            return getattr(self, what) * measured["bf16_tflops"] / self.bf16_tflops
        return getattr(self, what) * DERATE[what]

    def gemm_ceiling(self, gemm: str) -> float:
        """Attainable TFLOP/s of a GEMM precision (see :meth:`ceiling`)."""
        self.peak_tflops(gemm)  # refuses mxfp8 on sm90
        field = {"bf16": "bf16_tflops", "fp8_rowwise": "fp8_tflops", "mxfp8": "mxfp8_tflops"}
        return self.ceiling(field[gemm])

    def low_precision(self) -> str:
        """The low-precision GEMM this GPU runs natively: ``mxfp8`` on sm100+, else
        ``fp8_rowwise``."""
        return "fp8_rowwise" if self.mxfp8_tflops is None else "mxfp8"

    def with_values(self, source: str, **values: Any) -> GPUSpec:
        """This spec with measured ``values`` (rates replace the ceilings; ``memory_bytes``
        and ``gpus_per_node`` replace the spec's), recorded as coming from ``source``."""
        rates = set(DERATE)
        plain = {"memory_bytes", "gpus_per_node"}
        unknown = sorted(set(values) - rates - plain)
        if unknown:
            raise GPUSpecError(
                f"{source}: unknown GPU spec fields {unknown}; known: {sorted(rates | plain)}"
            )
        for key, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise GPUSpecError(f"{source}: {key} = {value!r}; expected a number > 0")
        measured = {f: (v, w) for f, v, w in self.measured}
        measured |= {k: (float(v), source) for k, v in values.items() if k in rates}
        return dataclasses.replace(
            self,
            **{k: int(v) for k, v in values.items() if k in plain},
            measured=tuple((f, v, w) for f, (v, w) in sorted(measured.items())),
        )


DERATE = {
    "bf16_tflops": 768 / 989,
    "fp8_tflops": 768 / 989,
    "mxfp8_tflops": 768 / 989,
    "hbm_gbps": 4100 / 4800,
    "nvlink_gbps": 0.9,
    "inter_node_gbps": 0.8,
}
"""Attainable share of a datasheet rate where nothing was measured: the H200's measured
ceilings over its datasheet (GEMM 768 / 989, HBM 4.1 / 4.8 TB/s); links 0.9 (NVLink) and
0.8 (network) of their nominal rate, unmeasured guesses a GPU session should replace."""

# Datasheets (dense, no sparsity): NVIDIA H100 and H200 Tensor Core GPU datasheets (SXM:
# BF16 989 TFLOP/s, FP8 1979 TFLOP/s; H100 80 GB HBM3 at 3.35 TB/s; H200 141 GB HBM3e at
# 4.8 TB/s; NVLink 4, 900 GB/s per GPU = 450 GB/s each way), the HGX B200 / HGX B300 pages
# (per GPU, dense: BF16 2.25 PFLOP/s, FP8 and MXFP8 4.5 PFLOP/s; B200 180 GB HBM3e at 7.7 TB/s;
# B300 288 GB HBM3e at 8 TB/s; NVLink 5, 1.8 TB/s per GPU = 900 GB/s each way). Memory is
# what the device reports where known (nvidia-smi: H100 SXM 81559 MiB; the report's Table 45:
# B300 275,040 MiB; RESULTS.md session 7: H200 139.8 GiB). Inter-node: one 400 Gb/s NDR rail
# per Hopper GPU (50 GB/s), one 800 Gb/s XDR rail per Blackwell GPU (100 GB/s; Table 45).
_H200_MEASURED = (
    # benchmarks/RESULTS.md, one H200 (sessions 4-5): the fastest dense cuBLAS bf16 GEMM
    # measured, 768 TFLOP/s at 131072 x 1536 x 3072; the AdamW kernel at ~4.1 TB/s.
    ("bf16_tflops", 768.0, "RESULTS.md: cuBLAS bf16 131072x1536x3072"),
    ("hbm_gbps", 4100.0, "RESULTS.md: AdamW kernel"),
    # 2 H200s over NV18 (EP = 2, session 4): NCCL all-to-all 519 GB/s per GPU; rowwise
    # dispatch 365 and combine 317 GB/s per GPU (the EP model's path factors, time.py).
    ("nvlink_gbps", 519.0, "RESULTS.md: NCCL all-to-all, EP=2"),
    # RESULTS.md session 21, one H200: a dense FFN of the e2e model (24576 tokens, d 1536,
    # SwiGLU 24576) with both projections fp8_rowwise (quantizers and bf16 weight gradients
    # included) ran its GEMMs at 891 TFLOP/s where bf16 ran 723 (the GLU's time taken out of
    # both), i.e. 768 x 891 / 723. The expert MLPs' fp8 share is Efficiency.fp8_rowwise_experts.
    ("fp8_tflops", 946.0, "RESULTS.md session 21: fp8_rowwise dense FFN, 891 vs 723 bf16"),
)
GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100", 81559 * MIB, 989.0, 1979.0, None, 3350.0, 450.0, 50.0),
    "h200": GPUSpec(
        "H200",
        round(139.8 * GIB),
        989.0,
        1979.0,
        None,
        4800.0,
        450.0,
        50.0,
        measured=_H200_MEASURED,
    ),
    "b200": GPUSpec(
        "B200", 180 * 10**9, 2250.0, 4500.0, 4500.0, 7700.0, 900.0, 100.0, arch="sm100"
    ),
    "b300": GPUSpec(
        "B300", 275040 * MIB, 2250.0, 4500.0, 4500.0, 8000.0, 900.0, 100.0, arch="sm103"
    ),
}


def gpu_spec(
    name: str,
    probe: str | Path | dict[str, Any] | None = None,
    inter_node_gbps: float | None = None,
) -> GPUSpec:
    """The spec of GPU ``name`` (case-insensitive), with a probe's measured values (a JSON file
    or a dict of rate fields) and the inter-node bandwidth given replacing the ceilings."""
    key = name.lower().removesuffix("-sxm")
    if key not in GPUS:
        raise GPUSpecError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    spec = GPUS[key]
    if probe is not None:
        values, source = _probe_values(probe)
        spec = spec.with_values(source, **values)
    if inter_node_gbps is not None:
        spec = spec.with_values("--inter-node-gbps", inter_node_gbps=inter_node_gbps)
    return spec


def spec_of_device(device_name: str) -> GPUSpec | None:
    """The datasheet spec of the GPU a CUDA device name names (``torch.cuda.get_device_name``,
    e.g. "NVIDIA H200"), or None for a GPU :data:`GPUS` does not hold."""
    return next((spec for spec in GPUS.values() if spec.name in device_name), None)


def _probe_values(probe: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(probe, dict):
        return dict(probe), "probe"
    path = Path(probe)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GPUSpecError(f"probe file {str(path)!r}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise GPUSpecError(f"probe file {str(path)!r}: expected a JSON object of GPU spec fields")
    data.pop("device", None)  # probe_gpu records the device name beside the values
    return data, f"probe {path.name}"


def probe_gpu(out: str | Path | None = None, size: int = 8192, repeats: int = 20) -> dict:
    """Measure the current CUDA device: dense bf16 GEMM ``size``^3 (TFLOP/s), a device-to-device
    copy of 1 GiB (GB/s: bytes read + written), and, with two GPUs visible, a 1 GiB peer copy
    GPU 0 -> GPU 1 (GB/s, one direction). Writes the JSON to ``out`` when given."""
    import torch

    if not torch.cuda.is_available():
        raise GPUSpecError("--probe needs a CUDA device; none is visible")
    dev = torch.device("cuda", 0)
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    gemm_s = _time_cuda(lambda: a @ b, repeats)
    src = torch.empty(GIB // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src), repeats)
    values: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "bf16_tflops": 2 * size**3 / gemm_s / 1e12,
        "hbm_gbps": 2 * src.numel() * src.element_size() / copy_s / 1e9,
        "memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
    }
    if torch.cuda.device_count() > 1:
        peer = torch.empty_like(src, device=torch.device("cuda", 1))
        peer_s = _time_cuda(lambda: peer.copy_(src), repeats)
        values["nvlink_gbps"] = src.numel() * src.element_size() / peer_s / 1e9
    if out is not None:
        Path(out).write_text(json.dumps(values, indent=2))
    return values


def _time_cuda(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn`` on the current stream (3 warm-up calls)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]
