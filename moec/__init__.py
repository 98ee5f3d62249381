"""moec: compile a dense PyTorch model and a plan into a Mixture-of-Experts training program.

import moec
compiled = moec.compile(model, moec.Plan.from_dict({"moe": {"num_experts": 8, "top_k": 2}}),
                        example_inputs=(tokens,))
loss = loss_fn(compiled(tokens)) + compiled.aux_loss()

The names below are imported on first use (:mod:`moec.lazy`), after :mod:`moec.ops`, which
registers the ``moec::`` ops (and their CUDA kernels where CUDA is available): ``import moec``
and the ``moec`` command's parser import no torch.
"""

from moec.lazy import lazy_exports

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

_EXPORTS = {
    "CaptureError": "moec.frontend",
    "CompiledModel": "moec.runtime.compiled",
    "MoecError": "moec.errors",
    "Plan": "moec.plan",
    "PlanError": "moec.plan",
    "Program": "moec.program",
    "compile": "moec.compiler",
    "register_activation": "moec.ops.activations",
    "trace": "moec.frontend",
}
# the first name read imports all of them, as ``import moec`` did before it was lazy: code that
# reads moec.runtime.compiled (say) after ``import moec`` finds it
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS, before=("moec.ops", *_EXPORTS.values()))
