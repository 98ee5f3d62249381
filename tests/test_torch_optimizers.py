"""The optimizers users write, on bf16 programs.

A bf16 program reads its float32 parameters through bf16 working copies. torch's optimizers
(AdamW, Adam, SGD in their for-loop, foreach and fused implementations) need a float32
parameter's gradient in float32, so that is what the program hands them by default; only
``moec.optim.AdamW``, built with the program's working weights, keeps the gradients in bf16
(``WorkingWeights.keep_gradients``). Both train the same model: torch's AdamW equals moec's
to float rounding over ten steps.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moec
from moec.optim import AdamW
from moec.train import LanguageModelWithLoss
from tests.models import hf_model, tiny_llama, tokens

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True},
    "precision": {"compute_dtype": "bf16"},
}
IMPLEMENTATIONS = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def _program(model: torch.nn.Module, ids: torch.Tensor) -> moec.CompiledModel:
    torch.manual_seed(0)
    return moec.compile(LanguageModelWithLoss(model), PLAN, (ids[:, :-1], ids[:, 1:]))


def _train(compiled, optimizer, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_torch_adamw_trains_a_bf16_program_as_moecs_adamw_does(implementation):
    batches = [tokens(2, 17) for _ in range(2)] * 5  # seen again: the loss must fall
    ours = _program(tiny_llama(2), batches[0])
    theirs, pristine = copy.deepcopy(ours), copy.deepcopy(ours)
    assert ours.working_weights is not None and len(ours.working_weights) > 0
    options = {"lr": 1e-2, "weight_decay": 0.1}
    moec_losses = _train(
        ours, AdamW(ours.parameters(), **options, working_weights=ours.working_weights), batches
    )
    torch_optimizer = torch.optim.AdamW(
        theirs.parameters(), **options, **IMPLEMENTATIONS[implementation]
    )
    torch_losses = _train(theirs, torch_optimizer, batches)
    assert all(p.grad.dtype == torch.float32 for p in theirs.parameters())
    # moec's update is torch's single-tensor AdamW (equal to the foreach one here): bit for bit.
    # The fused kernel orders its float32 arithmetic otherwise: one step's weights agree to
    # float32 rounding; over the run a bf16 ulp of a weight can flip a route, after which
    # single weights take their own way, so the ten steps are compared by their losses
    if implementation != "fused":
        torch.testing.assert_close(torch_losses, moec_losses, atol=0, rtol=0)
        for (name, want), got in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    else:
        # a flipped route moves later losses by up to ~6e-3 (seed 1125902521); stale bf16
        # copies, which the losses guard against, moved them by 0.12 at step 3
        torch.testing.assert_close(torch_losses, moec_losses, atol=2e-2, rtol=0)
        one_ours, one_theirs = copy.deepcopy(pristine), copy.deepcopy(pristine)
        moec_step = AdamW(
            one_ours.parameters(), **options, working_weights=one_ours.working_weights
        )
        _train(one_ours, moec_step, batches[:1])
        _train(
            one_theirs,
            torch.optim.AdamW(one_theirs.parameters(), **options, fused=True),
            batches[:1],
        )
        pairs = zip(one_ours.named_parameters(), one_theirs.parameters(), strict=True)
        for (name, want), got in pairs:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)
    # the run learned: these are not two idle optimizers agreeing
    assert torch_losses[-1] < torch_losses[0] - 0.1


@pytest.fixture(scope="module")
def _hf_program_compiled() -> tuple[moec.CompiledModel, torch.Tensor, list[torch.Tensor]]:
    """One bf16 program of a transformers Llama for the module, its inputs, its initial
    parameters (compiled once: every optimizer below steps the same program)."""
    ids = tokens(2, 17)
    compiled = _program(hf_model("llama"), ids)
    return compiled, ids, [p.detach().clone() for p in compiled.parameters()]


@pytest.fixture
def hf_program(_hf_program_compiled) -> tuple[moec.CompiledModel, torch.Tensor]:
    """The module's program with its initial parameters written back and no gradients: each
    test starts from the compiled state (the writes move the parameters' versions, so the
    working copies are remade from them)."""
    compiled, ids, initial = _hf_program_compiled
    with torch.no_grad():
        for param, value in zip(compiled.parameters(), initial, strict=True):
            param.copy_(value)
            param.grad = None
    return compiled, ids


@pytest.mark.parametrize(
    "optimizer",
    [
        *(f"{kind}:{impl}" for kind in ("Adam", "AdamW") for impl in IMPLEMENTATIONS),
        *(f"SGD:{impl}" for impl in ("for-loop", "foreach", "fused")),
        "Adagrad:for-loop",
        "RMSprop:foreach",
    ],
)
def test_torch_optimizers_step_every_parameter_of_a_bf16_hf_program(optimizer, hf_program):
    kind, implementation = optimizer.split(":")
    compiled, ids = hf_program
    assert compiled.working_weights is not None
    options = dict(IMPLEMENTATIONS[implementation])
    if kind == "SGD":
        options["momentum"] = 0.9
    step = getattr(torch.optim, kind)(compiled.parameters(), lr=1e-2, **options)
    before = {name: p.detach().clone() for name, p in compiled.named_parameters()}
    for _ in range(2):
        step.zero_grad(set_to_none=True)
        compiled(ids[:, :-1], ids[:, 1:]).backward()
        step.step()
    for name, param in compiled.named_parameters():
        assert param.grad is not None and param.grad.dtype == param.dtype, name
        assert not torch.equal(param, before[name]), f"{optimizer} left {name} unchanged"
    # the working copies follow: the next forward reads the stepped weights
    loss = compiled(ids[:, :-1], ids[:, 1:])
    assert torch.isfinite(loss)


def test_moec_adamw_keeps_bf16_gradients_only_for_its_own_parameters():
    ids = tokens(2, 17)
    compiled = _program(tiny_llama(2), ids)
    copied = [p for p in compiled.parameters() if compiled.working_weights.copy_of(p) is not None]
    AdamW(copied[:1], working_weights=compiled.working_weights)
    compiled(ids[:, :-1], ids[:, 1:]).backward()
    assert copied[0].grad.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for p in copied[1:])


@pytest.mark.slow  # the bundled 4-block Llama, 10 steps of 8 x 128 tokens
def test_the_readmes_python_example_trains_with_torch_adamw_in_bf16():
    """The README's first Python block, run as written."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(import moec, torch\n.*?)```", text, re.S).group(1)
    assert "torch.optim.AdamW" in code and '"bf16"' in code
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["compiled"].plan.precision.compute_dtype == "bf16"
    assert torch.isfinite(namespace["loss"])


def test_moec_adamw_steps_cpu_tensors_without_triton():
    """A CPU-only torch build comes without Triton: moec's AdamW then steps by its reference
    (``moec demo`` on such an install crashed importing the Triton kernel)."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # import triton raises, as where it is absent
        "import torch\n"
        "from moec.optim import AdamW\n"
        "w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.ones(4)\n"
        "AdamW([w], lr=0.1).step()\n"
        "assert bool((w < 1).all()), w\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
