"""``moec::linear_cross_entropy`` and the ``fused_loss`` pass equal the unfused head and loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import moec
from moec.kernels.target import Target
from moec.ops import loss as loss_op
from moec.ops.loss import linear_cross_entropy_reference
from moec.passes.base import PassContext
from moec.passes.loss import FusedLossPass
from moec.train import LanguageModelWithLoss
from tests.models import tiny_llama, tokens


def _inputs(rows: int, dim: int, vocab: int, bias: bool, dtype=torch.float32):
    h = torch.randn(rows, dim, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, dim, dtype=dtype) / dim**0.5).requires_grad_()
    b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (rows,))
    targets[::5] = -100
    return h, weight, b, targets


def _grads(loss: torch.Tensor, tensors) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss * 1.7, [t for t in tensors if t is not None]))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_op_equals_reference_over_several_chunks(reduction, bias):
    h, weight, b, targets = _inputs(300, 24, 70, bias)
    chunk = 128 * 70  # 3 chunks, the last one short
    assert loss_op.chunk_rows(300, 70, chunk) == 128 and loss_op.chunk_rows(300, 70) >= 300
    op = torch.ops.moec.linear_cross_entropy
    got = op(h, weight, b, targets, -100, reduction, chunk_elements=chunk)[0]
    want = linear_cross_entropy_reference(h, weight, b, targets, -100, reduction)
    torch.testing.assert_close(got, want)
    for a, e in zip(_grads(got, (h, weight, b)), _grads(want, (h, weight, b)), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)  # float32 sums in another order


def test_op_without_grads_gives_the_loss_alone():
    h, weight, b, targets = _inputs(300, 24, 70, True)
    full = torch.ops.moec.linear_cross_entropy(h, weight, b, targets, -100, "mean")
    loss, *grads = torch.ops.moec.linear_cross_entropy(h, weight, b, targets, -100, "mean", False)
    assert torch.equal(loss, full[0]) and all(g.numel() == 0 for g in grads)
    with pytest.raises(RuntimeError, match="with_grads=False"):
        loss.backward()


def test_op_gradcheck_float64():
    h, weight, b, targets = _inputs(7, 5, 11, True, torch.float64)

    def fn(h, weight, b):
        return torch.ops.moec.linear_cross_entropy(h, weight, b, targets, -100, "mean")[0]

    assert torch.autograd.gradcheck(fn, (h, weight, b))


def test_op_under_autocast_matches_the_autocast_head():
    h, weight, _, targets = _inputs(64, 32, 50, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.moec.linear_cross_entropy(h, weight, None, targets, -100, "mean")[0]
        want = F.cross_entropy(F.linear(h, weight).float(), targets)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for a, e in zip(_grads(got, (h, weight)), _grads(want, (h, weight)), strict=True):
        assert a.dtype == torch.float32  # gradients come back in the masters' dtype
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-3)


def test_op_errors_name_the_argument():
    h, weight, _, targets = _inputs(8, 4, 6, False)
    with pytest.raises(ValueError, match="reduction 'none'"):
        torch.ops.moec.linear_cross_entropy(h, weight, None, targets, -100, "none")
    with pytest.raises(ValueError, match="targets"):
        torch.ops.moec.linear_cross_entropy(h, weight, None, targets.float(), -100, "mean")


def _compiled(fused: bool, model: torch.nn.Module, ids: torch.Tensor):
    plan = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1}, "loss": {"fused": fused}}
    return moec.compile(model, plan, (ids[:, :-1], ids[:, 1:]))


def test_pass_fuses_the_head_and_keeps_loss_and_gradients():
    torch.manual_seed(0)
    ids = tokens(2, 17)
    base = LanguageModelWithLoss(tiny_llama())
    fused, unfused = (_compiled(f, base, ids) for f in (True, False))
    assert fused.pass_results["fused_loss"].stats["fused"] == 1
    targets = [n.target for n in fused.graph_module.graph.nodes]
    assert torch.ops.moec.linear_cross_entropy.default in targets
    assert torch.ops.aten.cross_entropy_loss.default not in targets
    assert "fused_loss" not in unfused.pass_results
    losses = [c(ids[:, :-1], ids[:, 1:]) for c in (fused, unfused)]
    torch.testing.assert_close(losses[0], losses[1])
    grads = [torch.autograd.grad(loss, list(c.parameters())) for loss, c in
             zip(losses, (fused, unfused))]  # fmt: skip
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _chunk_steps(monkeypatch) -> list[int]:
    """Records the rows per chunk of each fused loss's chunks (``loss_op._chunks``' step)."""
    steps: list[int] = []
    original = loss_op._chunks
    monkeypatch.setattr(loss_op, "_chunks", lambda *a: steps.append(a[6]) or original(*a))
    return steps


def test_the_chunk_bound_is_the_targets_bound_at_compile_time(monkeypatch):
    """``Target.loss_chunk_elements`` reaches the op through pass ``bind`` (its argument,
    recorded in the program's bindings): chunks of 128 rows (the least a chunk holds) at 2^14
    logits instead of the whole batch at the default; the loss is the same."""
    torch.manual_seed(0)
    ids = tokens(4, 65)  # 256 rows of a 256-token vocabulary
    base = LanguageModelWithLoss(tiny_llama())
    plan = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1}}
    small = dataclasses.replace(Target.detect("cpu"), loss_chunk_elements=1 << 14)
    compiled = [moec.compile(base, plan, (ids[:, :-1], ids[:, 1:]), target=t)
                for t in (Target.detect("cpu"), small)]  # fmt: skip
    fused = [
        n for n in compiled[1].graph_module.graph.nodes
        if n.target is torch.ops.moec.linear_cross_entropy.default
    ]  # fmt: skip
    assert [n.kwargs["chunk_elements"] for n in fused] == [1 << 14]
    assert "chunks of at most 16 Ki logits" in compiled[1].program.bindings[fused[0].name]
    steps = _chunk_steps(monkeypatch)
    losses = [c(ids[:, :-1], ids[:, 1:]) for c in compiled]
    assert steps == [256, 128]
    torch.testing.assert_close(losses[0], losses[1])


def test_no_grad_calls_run_the_loss_without_head_gradients(monkeypatch):
    torch.manual_seed(0)
    ids = tokens(2, 17)
    fused = _compiled(True, LanguageModelWithLoss(tiny_llama()), ids)
    seen = []
    original = loss_op._grad_buffers
    monkeypatch.setattr(loss_op, "_grad_buffers", lambda *a: seen.append(a[-1]) or original(*a))
    training = fused(ids[:, :-1], ids[:, 1:])
    with torch.no_grad():
        evaluation = fused(ids[:, :-1], ids[:, 1:])
    assert seen == [True, False]  # the training forward computed gradients, the other did not
    torch.testing.assert_close(evaluation, training.detach())
    with torch.no_grad():  # built once; rebuilt when a buffer is replaced (as .to() does)
        program = fused._graph()
        assert fused._graph() is program
        name, buffer = next(iter(fused.graph_module.named_buffers()))
        owner, _, leaf = name.rpartition(".")
        fused.graph_module.get_submodule(owner).register_buffer(leaf, buffer.clone())
        assert fused._graph().get_buffer(name) is fused.graph_module.get_buffer(name)
    training.backward()  # the training graph is untouched
    assert all(p.grad is not None for p in fused.parameters() if p.requires_grad)


class _LossAndLogits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama(2)

    def forward(self, inputs, targets):
        logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), logits


def test_pass_leaves_a_head_whose_logits_are_returned():
    ids = tokens(2, 9)
    compiled = _compiled(True, _LossAndLogits(), ids)
    stats = compiled.pass_results["fused_loss"].stats
    assert stats["fused"] == 0 and "also read elsewhere" in stats["skipped"][0]


class _HalvedClasses(torch.nn.Module):
    """A view between head and loss that splits the class dimension: not a fusable head."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 10, bias=False)

    def forward(self, h, targets):
        return F.cross_entropy(self.head(h).view(-1, 5), targets)


def test_pass_leaves_a_head_whose_classes_are_reshaped():
    h, targets = torch.randn(6, 8), torch.randint(0, 5, (12,))
    gm = moec.trace(_HalvedClasses(), (h, targets))
    result = FusedLossPass().run(gm, PassContext(moec.Plan()))
    assert not result.modified and "class dimension" in result.stats["skipped"][0]


def test_pipelined_program_fuses_the_head_into_its_last_stage():
    """pp = 2: the pass runs before the split, the last stage returns the fused loss and reads
    the targets itself (not sent from stage 0); running the stage graphs one after the other
    gives the unfused PP = 1 program's loss (mean over the non-ignored tokens) and gradients."""
    torch.manual_seed(0)
    ids = tokens(2, 17)
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[:, ::4] = -100  # ignored positions: the mean is over the others, as at PP = 1
    base = LanguageModelWithLoss(tiny_llama())
    moe = {"num_experts": 4, "top_k": 2, "dense_first": 1}
    plan = {"moe": moe, "parallel": {"pp": 2, "microbatches": 2}}
    piped = moec.compile(base, plan, (inputs, targets))
    unfused = _compiled(False, base, ids)
    assert piped.pass_results["fused_loss"].stats["fused"] == 1
    split = piped.program.pipeline
    first, last = split.stages
    assert split.info[0].inputs == ["inputs", "targets"]
    assert split.info[1].inputs[-1] == "targets" and "targets" not in split.info[0].outputs
    assert torch.ops.moec.linear_cross_entropy.default in [n.target for n in last.graph.graph.nodes]
    sends = first.graph(inputs, targets)[: first.signature.num_user_outputs]
    loss = last.graph(*sends, targets)[0]
    assert loss.dim() == 0
    expected = unfused(inputs, targets)
    torch.testing.assert_close(loss, expected)
    params = [p for p in unfused.parameters() if p.requires_grad]
    names = [n for n, p in unfused.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, [dict(piped.named_parameters())[n] for n in names])
    want = torch.autograd.grad(expected, params)
    for name, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
