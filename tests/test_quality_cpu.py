"""The quality benchmark at CPU scale (``benchmarks/quality.py --scale cpu``): parity of moec's
MoE with an independent plain-PyTorch one, and the upcycling arms, on a corpus built from
moec's own sources. Each asserts only what these short runs show with a margin across seeds:
numbers about the field's claims need the GPU scale (``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import quality
from moec.corpus_build import BuildOptions, build_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "built"
    sources = (str(Path(quality.__file__).parents[1] / "moec"),)
    build_corpus(out, BuildOptions(sources=sources, vocab_size=2048, eval_fraction=0.05))
    return out


def _run(experiment: str, corpus: Path, out: Path, *extra: str) -> dict:
    args = [experiment, "--corpus", str(corpus), "--out", str(out), "--scale", "cpu", *extra]
    return quality.main(args)


def test_moec_and_an_independent_moe_learn_alike(corpus, tmp_path):
    result = _run("parity", corpus, tmp_path, "--steps", "50", "--seeds", "0,1")
    runs = result["runs"]
    for run in runs:  # every run learns: 1 nat below the uniform loss, ln(2048) = 7.6
        assert run["eval_loss"][-1] < math.log(2048) - 1, run["name"]
    final = result["verdict"]["final_eval_loss"]
    for ours, theirs in zip(final["moec"], final["independent"], strict=True):
        # from identical weights and batches the two differ only by rounding, which 50 steps
        # at a high learning rate amplify to ~0.01-0.02 here
        assert abs(ours - theirs) < 0.1
    assert (tmp_path / "parity.json").is_file() and (tmp_path / "parity.png").is_file()


def test_upcycled_arms_continue_from_the_dense_model(corpus, tmp_path):
    result = _run("upcycle", corpus, tmp_path, "--steps", "50", "--seeds", "0")
    pre = result["pretraining"]["eval_loss"][-1]
    runs = {r["name"]: r for r in result["runs"]}
    scratch = runs["MoE from scratch"]
    # a fresh MoE starts near the uniform loss, ln(2048) = 7.6, and learns
    assert scratch["start_eval_loss"] > math.log(2048) - 0.5
    assert scratch["eval_loss"][-1] < math.log(2048) - 1
    for name in ("upcycled", "granular", "dense continued"):
        # function-preserving starts: before their first step they are the pretrained model
        # (to rounding, ~2e-7 here)
        assert runs[name]["start_eval_loss"] == pytest.approx(pre, abs=1e-4), name
    # drop-upcycling re-initializes half of each expert's weights: it is no longer the model it
    # came from (0.01 away here, above or below it as the corpus, moec's sources, changes), and
    # starts far below a fresh MoE
    drop = runs["drop-upcycled"]["start_eval_loss"]
    assert drop != pytest.approx(pre, abs=1e-4)
    assert drop < scratch["start_eval_loss"] - 0.5
    for run in result["runs"]:
        assert run["eval_loss"][-1] < math.log(2048) - 1, run["name"]
        assert run["tokens"][-1] > 0 and run["flops"][-1] > run["flops"][0]
