"""moec.kernels.gemm_backend: which grouped-GEMM implementation runs for which operands.

CUDA operands are fake tensors (no GPU needed) and the arch is set by monkeypatching, so every
branch of the one decision is checked on the CPU: dtype, device, arch, row count, piece, the
policy (the measured rules, with or without the CuTe DSL, or one backend forced: what a
:class:`~moec.kernels.target.Target` makes), and whether moec's kernels or the ops'
pure-PyTorch path (no policy) asks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moec.kernels import gemm_backend as gb
from moec.kernels.target import Target

RULES = gb.GemmPolicy(quack=True)
"""The measured rules with the CuTe DSL."""
NO_QUACK = gb.GemmPolicy(quack=False)


def _fake_cuda(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    with FakeTensorMode():
        x = torch.empty(rows, 64, device="cuda", dtype=dtype)
        w = torch.empty(4, 64, 32, device="cuda", dtype=dtype)
    return x, w


@pytest.fixture
def sm(monkeypatch: pytest.MonkeyPatch):
    """Set the arch every CUDA tensor reports; the TMA kernel takes any operands."""
    monkeypatch.setattr(gb, "tma_applies", lambda x, w: True)

    def set_arch(name: str) -> None:
        monkeypatch.setattr(gb, "arch", lambda device: name)

    return set_arch


def _rule_at(piece: str, rows: int, arch: str = "sm90") -> str:
    """The table's backend for ``rows`` (the last rule reached)."""
    return [chosen for min_rows, chosen in gb.GEMM_BACKENDS[arch][piece] if rows >= min_rows][-1]


def test_every_arch_table_has_every_piece_with_ascending_rules_from_zero_rows():
    for arch, table in gb.GEMM_BACKENDS.items():
        assert set(table) == set(gb.PIECES), arch
        for piece, rules in table.items():
            thresholds = [min_rows for min_rows, _ in rules]
            assert thresholds[0] == 0 and thresholds == sorted(thresholds), (arch, piece)
            assert len(set(rules)) == len(rules), (arch, piece)


@pytest.mark.parametrize("piece", gb.PIECES)
def test_kernels_bf16_on_sm90_follow_the_rules_at_each_threshold(sm, piece):
    sm("sm90")
    for min_rows, _ in gb.GEMM_BACKENDS["sm90"][piece]:
        x, w = _fake_cuda(min_rows, torch.bfloat16)
        assert gb.backend(piece, x, w, RULES) == _rule_at(piece, min_rows)
        if min_rows:
            below, w = _fake_cuda(min_rows - 1, torch.bfloat16)
            assert gb.backend(piece, below, w, RULES) == _rule_at(piece, min_rows - 1)


def test_a_backend_that_does_not_take_the_operands_passes_to_the_rule_before(sm, monkeypatch):
    sm("sm90")
    rules = ((0, "pointer"), (64, "grouped_mm"), (128, "cute"), (256, "cute_glu"))
    monkeypatch.setitem(gb.GEMM_BACKENDS, "sm90", dict.fromkeys(gb.PIECES, rules))
    x, w = _fake_cuda(256, torch.bfloat16)
    assert gb.backend("up", x, w, RULES, glu_epilogue=True) == "cute_glu"
    assert gb.backend("up", x, w, RULES) == "cute"  # no gated epilogue for this call
    assert gb.backend("up", x, w, NO_QUACK, glu_epilogue=True) == "grouped_mm"
    with FakeTensorMode():
        unaligned = torch.empty(4, 64, 36, device="cuda", dtype=torch.bfloat16)  # 72-byte rows
    assert gb.backend("down", x, unaligned, RULES) == "grouped_mm"


@pytest.mark.parametrize("arch,dtype", [("sm90", torch.float32), ("sm90", torch.float16),
                                        ("other", torch.bfloat16)])  # fmt: skip
def test_kernels_run_the_pointer_kernels_off_the_table(sm, arch, dtype):
    sm(arch)
    x, w = _fake_cuda(1 << 20, dtype)
    assert {gb.backend(piece, x, w, RULES) for piece in gb.PIECES} == {"pointer"}


def test_tma_never_runs_wgrad_nor_operands_it_does_not_take(sm, monkeypatch):
    sm("sm90")
    x, w = _fake_cuda(4096, torch.bfloat16)
    tma = gb.GemmPolicy.parse("tma")
    assert gb.backend("dgrad", x, w, tma) == "tma"
    assert gb.backend("wgrad", x, w, tma) == "pointer"
    monkeypatch.setattr(gb, "tma_applies", lambda x, w: False)
    assert gb.backend("dgrad", x, w, tma) == "pointer"


@pytest.mark.parametrize("chosen", ["pointer", "tma", "grouped_mm", "cute"])
def test_a_target_forcing_a_backend_runs_it_for_every_piece_and_size(sm, chosen):
    """A target's ``gemm`` forces one backend (the benchmarks' comparison) through the policy
    it makes; the measured rules are not touched: the rules' policy still follows them."""
    sm("sm100")
    x, w = _fake_cuda(8, torch.bfloat16)
    before = {piece: gb.backend(piece, x, w, RULES) for piece in gb.PIECES}
    forced = Target(device="cuda", arch="sm100", triton=True, quack=True, gemm=chosen)
    assert forced.gemm_policy() == gb.GemmPolicy.parse(chosen)
    assert forced.expert_impl("bf16") == f"kernels:{chosen}"
    for piece in gb.PIECES:
        want = "pointer" if chosen == "tma" and piece == "wgrad" else chosen
        assert gb.backend(piece, x, w, forced.gemm_policy()) == want
    assert {piece: gb.backend(piece, x, w, RULES) for piece in gb.PIECES} == before


def test_policy_specs_round_trip_and_unknown_ones_are_refused():
    for spec in ("rules", "rules+quack", *gb.KERNEL_BACKENDS):
        assert gb.GemmPolicy.parse(spec).spec() == spec
    with pytest.raises(ValueError, match="unknown grouped-GEMM policy 'fast'"):
        gb.GemmPolicy.parse("fast")
    with pytest.raises(ValueError, match="Target.gemm = 'fast'"):
        Target(gemm="fast")


def test_kernels_on_the_cpu_interpreter_run_the_pointer_kernels():
    x, w = torch.randn(4096, 64).bfloat16(), torch.randn(4, 64, 32).bfloat16()
    assert {gb.backend(piece, x, w, RULES) for piece in gb.PIECES} == {"pointer"}


@pytest.mark.parametrize("arch,want", [("sm90", "grouped_mm"), ("sm100", "grouped_mm"),
                                       ("other", "loop")])  # fmt: skip
def test_reference_path_on_cuda_takes_grouped_mm_for_bf16_on_sm90_and_later(sm, arch, want):
    sm(arch)
    x, w = _fake_cuda(16, torch.bfloat16)  # any row count
    assert gb.backend("down", x, w) == want
    x, w = _fake_cuda(16, torch.float32)
    assert gb.backend("down", x, w) == "loop"


def test_reference_path_on_the_cpu_needs_float32_or_bf16_aligned_rows():
    x, w = torch.randn(16, 64), torch.randn(4, 64, 32)
    assert gb.backend("down", x, w) == "grouped_mm"
    assert gb.backend("down", x.bfloat16(), w.bfloat16()) == "grouped_mm"
    assert gb.backend("down", x.double(), w.double()) == "loop"
    odd = torch.randn(4, 64, 3)  # 12-byte rows
    assert gb.backend("down", x, odd) == "loop"
    narrow = torch.randn(4, 6, 32)  # its transpose has 24-byte rows: not for gmm, fine for wgrad
    assert gb.backend("down", torch.randn(16, 6), narrow) == "loop"
    assert gb.backend("wgrad", x, torch.randn(16, 32)) == "grouped_mm"
    with FakeTensorMode():  # torch's fake _grouped_mm takes bf16 only
        fake_x, fake_w = torch.empty(16, 64), torch.empty(4, 64, 32)
    assert gb.backend("down", fake_x, fake_w) == "loop"


def test_without_quack_its_rules_pass_to_the_ones_before(sm):
    sm("sm90")
    x, w = _fake_cuda(1 << 17, torch.bfloat16)
    assert {gb.backend(piece, x, w, RULES) for piece in gb.PIECES} == {"cute"}
    without = {piece: gb.backend(piece, x, w, NO_QUACK) for piece in gb.PIECES}
    assert without == {"up": "grouped_mm", "down": "grouped_mm", "dgrad": "tma",
                       "dgrad_act": "grouped_mm", "wgrad": "grouped_mm"}  # fmt: skip
    hopper = Target(device="cuda", arch="sm90", triton=True, quack=True)
    assert dataclasses.replace(hopper, quack=False).gemm_policy() == NO_QUACK
    assert hopper.gemm_policy() == RULES


def test_policy_text_names_every_piece_and_its_rules():
    text = gb.policy_text("sm90", RULES)
    assert "CuTe DSL may run" in text
    for piece in gb.PIECES:
        assert f"  {piece} " in text
    assert "cute from 4096 rows" in text and "pointer from 0 rows" in text
    assert "off: its rules pass" in gb.policy_text("sm90", NO_QUACK)
    assert "reference path" in gb.policy_text("interpreter", None)


def _fake_head(
    rows: int, dim: int, vocab: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    with FakeTensorMode():
        h = torch.empty(rows, dim, device="cuda", dtype=dtype)
        weight = torch.empty(vocab, dim, device="cuda", dtype=dtype)
    return h, weight


@pytest.fixture
def loss_arch(monkeypatch: pytest.MonkeyPatch):
    """Set the arch the fused loss sees."""
    from moec.kernels import cute_loss

    def set_arch(name: str) -> None:
        monkeypatch.setattr(cute_loss, "arch", lambda device: name)

    set_arch("sm90")
    return set_arch


def test_the_fused_loss_takes_bf16_heads_on_sm90_whose_tiles_divide_them(loss_arch):
    from moec.kernels import cute_loss

    h, weight = _fake_head(24576, 1536, 100352)  # the e2e model's head
    assert cute_loss.takes(h, weight, 8192)
    assert cute_loss.takes(_fake_head(1000, 1536, 100352)[0], weight, 1024)  # a short chunk
    assert not cute_loss.takes(h, weight, 8000)  # chunks of a multiple of 128 rows
    assert not cute_loss.takes(*_fake_head(24576, 1536, 100000), 8192)  # vocabulary
    assert not cute_loss.takes(*_fake_head(24576, 1540, 100352), 8192)  # rows not 16-B aligned
    assert not cute_loss.takes(*_fake_head(0, 1536, 100352), 128)
    # a chunk as long as the model is wide (here the last of 2560-row chunks: 24576 - 9 x 2560)
    assert not cute_loss.takes(h, weight, 2560)
    assert not cute_loss.takes(*_fake_head(3072, 1536, 100352), 1536)
    assert not cute_loss.takes(*_fake_head(24576, 1536, 100352, torch.float32), 8192)
    with FakeTensorMode():  # column-major
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        h_t = torch.empty_strided((24576, 1536), (1, 24576), **bf16)
        weight_t = torch.empty_strided((100352, 1536), (1, 100352), **bf16)
    assert not cute_loss.takes(h_t, weight, 8192)
    assert not cute_loss.takes(h, weight_t, 8192)
    loss_arch("sm100")  # the pipeline's operand-transform mainloop is Hopper's
    assert not cute_loss.takes(h, weight, 8192)
    cpu = torch.empty(256, 128, dtype=torch.bfloat16), torch.empty(1024, 128, dtype=torch.bfloat16)
    assert not cute_loss.takes(*cpu, 256)


def test_a_target_binds_the_fused_loss_only_with_quack_and_the_fused_loss_on():
    """The loss implementation is the target's choice: ``cute`` (quack's pipeline where it takes
    the head) needs quack and ``fused_loss``; without either the chunks run on the Triton rows;
    off CUDA the reference."""
    hopper = Target(device="cuda", arch="sm90", triton=True, quack=True)
    assert hopper.implementation("linear_cross_entropy") == "cute"
    no_quack = dataclasses.replace(hopper, quack=False)
    assert no_quack.implementation("linear_cross_entropy") == "triton"
    chunked = dataclasses.replace(hopper, fused_loss=False)
    assert chunked.implementation("linear_cross_entropy") == "triton"
    assert Target().implementation("linear_cross_entropy") == "reference"


@pytest.mark.parametrize(
    "arch,recipe,want",
    [("sm90", "fp8_rowwise", "native"), ("sm90", "mxfp8", "kernels"),
     ("sm100", "mxfp8", "native"), ("sm100", "fp8_rowwise", "kernels")],
)  # fmt: skip
def test_a_target_binds_low_precision_native_only_on_its_arch(arch, recipe, want):
    """fp8_rowwise is native on sm90 only (torch._scaled_grouped_mm is never called on sm100,
    where its fake-quantized operands run on the grouped-GEMM kernels), mxfp8 on sm100
    (elsewhere the Triton MXFP8 kernels emulate the MMA); a CPU target or one asking for the
    reference binds the pure-PyTorch path."""
    target = Target(device="cuda", arch=arch, triton=True)
    assert target.native_recipe == {"sm90": "fp8_rowwise", "sm100": "mxfp8"}[arch]
    assert target.expert_impl(recipe) == want
    assert dataclasses.replace(target, gemm="reference").expert_impl(recipe) == "reference"
    assert Target().expert_impl(recipe) == "reference"
