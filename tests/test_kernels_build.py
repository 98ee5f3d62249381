"""Every moec kernel compiles for sm_90, sm_100 and sm_103 on the CPU (Triton GPUTarget).

The build runs in subprocesses (one per arch, concurrently) so it never sees an interpreter
mode (``TRITON_INTERPRET``) other tests may have switched on; GEMM PTX must use the arch's MMA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CAPABILITIES = (90, 100, 103)


@pytest.mark.slow  # three whole builds, about 100 s on 2 cores
def test_every_kernel_builds_for_hopper_and_blackwell():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {
        cap: subprocess.Popen(
            [sys.executable, "-m", "moec.kernels.build", str(cap)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
        for cap in CAPABILITIES
    }
    for cap, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith(("ok", "FAIL"))]
        assert proc.returncode == 0, out
        assert len(lines) >= 12 and all(line.startswith("ok") for line in lines), out
        assert all(f"sm_{cap}" in line for line in lines)
