"""The CuTe DSL MXFP8 grouped GEMMs, built on the CPU for sm_100a and sm_103a.

:mod:`moec.kernels.cute_build` compiles quack-kernels' block-scaled grouped GEMM (varlen-M and
varlen-K, every default tile config) with the CuTe DSL, no GPU needed, and checks that the PTX
uses ``tcgen05.mma ... kind::mxf8f6f4.block_scale.block32``. The build test is skipped when the
DSL or quack is not installed; the checker's and the CLI's tests always run.
"""

from __future__ import annotations

import pytest

from moec.kernels import cute_build
from moec.kernels.cute_build import Variant

PAIR = Variant("m", 256, 256, 2, 1, False, True)
SINGLE = Variant("k", 128, 128, 1, 1, False, True)
ELF = b"\x7fELF" + bytes(60)


def _ptx(target: str, *mma: str) -> str:
    body = "\n".join(f"\t{op} [%r1], %rd2, %rd3, %r4, [%r5], [%r6], %p7;" for op in mma)
    return f".version 8.8\n.target {target}\n.address_size 64\n{body}\n"


BLOCK_SCALED_2 = "tcgen05.mma.cta_group::2.kind::mxf8f6f4.block_scale.block32.collector::a::discard"
BLOCK_SCALED_1 = BLOCK_SCALED_2.replace("cta_group::2", "cta_group::1")


@pytest.mark.parametrize("capability", [100, 103])
def test_check_accepts_the_block_scaled_build(capability):
    arch = cute_build.ARCHS[capability]
    assert cute_build.check_build(PAIR, capability, _ptx(arch, BLOCK_SCALED_2), ELF) is None
    assert cute_build.check_build(SINGLE, capability, _ptx(arch, BLOCK_SCALED_1), ELF) is None


@pytest.mark.parametrize(
    "variant, ptx, cubin, problem",
    [
        (PAIR, None, ELF, "no PTX"),
        (PAIR, _ptx("sm_90a", BLOCK_SCALED_2), ELF, "does not target sm_100a"),
        (PAIR, _ptx("sm_100a"), ELF, "no tcgen05.mma"),
        (PAIR, _ptx("sm_100a", "tcgen05.mma.cta_group::2.kind::f8f6f4"), ELF, "kind::mxf8f6f4"),
        (PAIR, _ptx("sm_100a", BLOCK_SCALED_2, "tcgen05.mma.cta_group::2.kind::mxf8f6f4"), ELF,
         "without block_scale"),
        (PAIR, _ptx("sm_100a", BLOCK_SCALED_2.replace("block32", "block16")), ELF, "block32"),
        (PAIR, _ptx("sm_100a", BLOCK_SCALED_1), ELF, "cta_group::2"),
        (SINGLE, _ptx("sm_100a", BLOCK_SCALED_2), ELF, "cta_group::1"),
        (PAIR, _ptx("sm_100a", BLOCK_SCALED_2), None, "no cubin"),
        (PAIR, _ptx("sm_100a", BLOCK_SCALED_2), b"not an ELF", "no cubin"),
    ],
)  # fmt: skip
def test_check_names_what_is_wrong(variant, ptx, cubin, problem):
    found = cute_build.check_build(variant, 100, ptx, cubin)
    assert found is not None and problem in found, found


def test_unknown_capability_is_refused():
    with pytest.raises(SystemExit) as exit_:
        cute_build.main(["90"])
    assert exit_.value.code == 2
    with pytest.raises(ValueError, match=r"capability \[90\].*accepted: \[100, 103\]"):
        cute_build.build([90])


def test_missing_packages_exit_2_with_the_install_line(monkeypatch, capsys):
    monkeypatch.setattr(cute_build, "missing", lambda: ["quack"])
    assert cute_build.main(["100", "103"]) == cute_build.MISSING_EXIT
    err = capsys.readouterr().err
    assert "quack not installed" in err and cute_build.INSTALL in err


@pytest.mark.skipif(
    bool(cute_build.missing()),
    reason=f"CuTe DSL / quack not installed ({cute_build.INSTALL})",
)
def test_blackwell_build_uses_block_scaled_tcgen05_mma():
    results = cute_build.build([100, 103])
    assert [r.capability for r in results] == [100, 103]
    for result in results:
        assert result.error is None, result.error
        names = [k.name for k in result.kernels]
        assert len(names) == 6 and len(set(names)) == 6, names
        assert {n.split("_")[3] for n in names} == {"m", "k"}, names  # varlen_m and varlen_k
        problems = {k.name: k.problem for k in result.kernels if k.problem}
        assert not problems, f"{cute_build.ARCHS[result.capability]}: {problems}"
        forms = {m for k in result.kernels for m in k.mma}
        assert any("cta_group::1" in f for f in forms) and any("cta_group::2" in f for f in forms)
