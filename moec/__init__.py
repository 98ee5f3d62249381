"""moec: compile a dense PyTorch model and a plan into a Mixture-of-Experts training program.

import moec
compiled = moec.compile(model, moec.Plan.from_dict({"moe": {"num_experts": 8, "top_k": 2}}),
                        example_inputs=(tokens,))
loss = loss_fn(compiled(tokens)) + compiled.aux_loss()
"""

import moec.ops  # noqa: F401  (registers the moec:: ops)
from moec.compiler import compile
from moec.errors import MoecError
from moec.frontend import CaptureError, trace
from moec.ops.activations import register_activation
from moec.plan import Plan, PlanError
from moec.program import Program
from moec.runtime.compiled import CompiledModel

__all__ = [
    "CaptureError",
    "CompiledModel",
    "MoecError",
    "Plan",
    "PlanError",
    "Program",
    "compile",
    "register_activation",
    "trace",
]
__version__ = "0.1.0"
