"""moec plan auto (issue #23, CPU core): the analytic memory against rank_memory of built
programs, the search against brute force, refusals, a large model's search time, GPU specs and
probe overrides, calibration of the time model."""

from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest
import torch

from moec.analysis.cost.time import (
    CalibrationError,
    Efficiency,
    OpSample,
    calibrate,
    collective_time,
    gemm_time,
    load_efficiency,
    load_samples,
    memory_time,
    read_trace,
    samples_from_trace,
    save_efficiency,
)
from moec.analysis.gpus import GPUS, GPUSpecError, gpu_spec, spec_of_device
from moec.analysis.rank_memory import rank_memory
from moec.autoplan import (
    NoPlanFitsError,
    Prediction,
    Request,
    Search,
    capture,
    profile_program,
)
from moec.autoplan.cli import cmd_plan_auto
from moec.autoplan.memory import rank_memory_of
from moec.cli import build_parser
from moec.compiler import build_program
from moec.debug import with_next_token_loss
from moec.models.zoo import load_model
from moec.plan import ParallelPlan, Plan, PlanError
from moec.program import EPGroup

MOE = {"num_experts": 8, "top_k": 2, "init": "random", "expert_width": 128, "dense_first": 1}


def _plan(parallel: dict | None = None, recompute: str = "none", fold: bool = False) -> Plan:
    return Plan.from_dict(
        {
            "moe": MOE,
            "parallel": parallel or {},
            "precision": {"compute_dtype": "bf16"},
            "recompute": {"policy": recompute},
            "lowering": {"combine_in_experts": fold},
        }
    )


def _build(plan: Plan):
    with torch.device("meta"):
        model, inputs, kwargs = load_model("llama")
    model, inputs = with_next_token_loss(model, inputs, kwargs, "llama")
    ep = plan.parallel.ep
    mesh = SimpleNamespace(ep_info=EPGroup(0, ep, "t")) if ep > 1 else None
    return build_program(model, plan, inputs, {}, mesh=mesh, verify=False)


@pytest.fixture(scope="module")
def profile():
    return capture("llama", _plan())


@pytest.mark.parametrize(
    "parallel, recompute, micro, fold",
    [
        ({}, "none", 1, False),
        ({"dp": 2, "dp_shard": 2}, "none", 1, False),
        # EP alone and two microbatches alone are each in this case (and micro 2 under fold)
        ({"dp": 4, "dp_shard": 4, "ep": 2}, "none", 2, False),
        ({}, "block", 1, False),
        ({}, "none", 2, True),
        ({}, "block", 1, True),
    ],
)
def test_memory_matches_rank_memory(profile, parallel, recompute, micro, fold):
    """Parameter state equals rank_memory's for the built program (FSDP + EP within 0.5%);
    activations within 10% (EP buffers and FSDP's groups are only in one of them; the
    recompute transient, only in the analytic peak, is taken out). ``fold``: the program
    with dispatch and combine folded into the expert MLPs, against the folded profile."""
    program = _build(_plan(parallel, recompute, fold))
    real = rank_memory(program, micro, 4, 64)
    p = {"dp": 1, "ep": 1, "dp_shard": 1, **parallel}
    mine = rank_memory_of(
        profile.folded if fold else profile,
        [list(range(profile.num_units))],
        [1],
        ep=p["ep"],
        dp=p["dp"],
        dp_shard=p["dp_shard"],
        microbatches=micro,
        batch=4,
        seq=64,
        recompute=recompute,
    )
    for field in ("parameters", "gradients", "optimizer", "working_copies", "gathered"):
        assert getattr(mine, field) == pytest.approx(getattr(real, field), rel=5e-3), field
    # rank_memory counts what a step keeps; the analytic peak adds recomputing one block
    transient = max(u.transient_block(4, 64) for u in profile.units) if recompute != "none" else 0
    assert mine.activations - transient == pytest.approx(real.activations, rel=0.10)


def test_search_equals_brute_force(profile):
    """Pruning loses nothing: the best plan and its time equal the exhaustive search's."""
    request = Request(8, gpu_spec("h200"), 64 * 128, 128, memory_fraction=0.92)
    pruned = Search(profile, request).best(3)
    brute_search = Search(profile, request)
    every = list(brute_search.candidates(prune=False))
    fitting = sorted(
        (p for p in every if p.memory.total <= brute_search.capacity),
        key=Prediction.rank_key,
    )
    assert len(every) > len(fitting) > 0 or len(every) == len(fitting)
    assert pruned[0].layout == fitting[0].layout
    assert pruned[0].step_s == fitting[0].step_s
    assert [p.step_s for p in pruned] == [p.step_s for p in fitting[:3]]


def test_tight_memory_search_equals_brute_force(profile):
    """Where memory binds (a tiny GPU), pruning still agrees with brute force."""
    roomy = Search(profile, Request(4, GPUS["h200"], 32 * 128, 128, memory_fraction=1.0))
    totals = sorted(p.memory.total for p in roomy.candidates(prune=False))
    mem = totals[len(totals) // 4]  # three quarters of the candidates do not fit
    gpu = GPUS["h200"].with_values("test", memory_bytes=mem)
    request = Request(4, gpu, 32 * 128, 128, memory_fraction=1.0)
    search = Search(profile, request)
    best = search.best(1)[0]
    brute = Search(profile, request)
    fitting = [p for p in brute.candidates(prune=False) if p.memory.total <= mem]
    assert min(p.step_s for p in fitting) == best.step_s
    assert len(fitting) < brute.evaluated  # memory excluded some layouts
    assert best.step_s > roomy.best(1)[0].step_s  # and the fastest of all among them


def test_folding_the_experts_keeps_less_and_is_offered_where_memory_needs_it(profile):
    """The folded profile keeps less in each MoE unit and the same elsewhere; the search offers
    the fold at EP = 1 with bf16 experts only (FP8 dense FFNs may sit beside it), prices it
    slower than the unfolded layout
    (``Efficiency.folded_experts``), and picks it (over block recompute, which costs more)
    where the unfolded one does not fit; its plan sets both lowering flags."""
    units = zip(profile.units, profile.folded.units, strict=True)
    for base, folded in units:
        assert folded.name == base.name
        kept, kept_folded = base.saved(4, 64), folded.saved(4, 64)
        assert kept_folded < kept if base.moe else kept_folded == kept
    request = Request(1, gpu_spec("h200"), 8 * 128, 128, fold_experts=True)
    every = list(Search(profile, request).candidates(prune=False))
    folds = [p for p in every if p.layout.fold_experts]
    assert folds and all(p.layout.ep == 1 and p.layout.expert_gemm == "bf16" for p in folds)
    for p in folds:
        twin = next(
            q for q in every if q.layout == dataclasses.replace(p.layout, fold_experts=False)
        )
        assert p.step_s > twin.step_s and p.memory.total <= twin.memory.total
        if p.layout.recompute == "none":  # under block recompute a dense block's may be the peak
            assert p.memory.total < twin.memory.total
    assert not Search(profile, request).best(1)[0].layout.fold_experts  # memory is plenty
    # the unfolded no-recompute layout of the largest microbatch no longer fits; its fold does
    largest = max(p.layout.micro_seqs for p in every)
    bare = next(
        p
        for p in every
        if p.layout.micro_seqs == largest
        and p.layout.recompute == "none"
        and p.layout.gemm == "bf16"
        and not p.layout.fold_experts
    )
    folded = next(
        p for p in folds if p.layout == dataclasses.replace(bare.layout, fold_experts=True)
    )
    mem = (bare.memory.total + folded.memory.total) / 2
    gpu = GPUS["h200"].with_values("test", memory_bytes=mem)
    tight = dataclasses.replace(request, gpu=gpu, memory_fraction=1.0)
    best = Search(profile, tight).best(3)
    assert best[0].layout.fold_experts and best[0].layout.recompute == "none"
    assert best[0].step_s <= min(p.step_s for p in best)
    lowering = best[0].plan(_plan()).lowering
    assert lowering.combine_in_experts
    unfolded = Search(profile, dataclasses.replace(tight, fold_experts=False))
    assert not any(p.layout.fold_experts for p in unfolded.candidates(prune=False))


def test_dense_ffn_precision_scope_is_searched_and_priced(profile):
    """The profile splits the dense block's FFN GEMMs out of its matmuls (its gate/up and down
    projections; no shared expert here); the search offers FP8 on the routed experts, the
    dense FFNs or both, prices each scope's GEMMs at its precision (the H200's FP8 runs a dense
    FFN faster than bf16, the routed experts slower: ``Efficiency.fp8_rowwise_experts``), may
    fold bf16 experts beside FP8 dense FFNs, and the chosen plan carries the scope."""
    b, seq = 2, 64
    dense = [u for u in profile.units if u.dense_ffn_flops(b, seq) > 0]
    assert [u.name for u in dense] == ["model.layers.0 (FFN)"]
    assert dense[0].dense_ffn_flops(b, seq) == dense[0].matmul_flops(b, seq) > 0
    request = Request(1, gpu_spec("h200"), 8 * 128, 128, fold_experts=True)
    search = Search(profile, request)
    every = list(search.candidates(prune=False))
    scopes = {(p.layout.gemm, p.layout.scope) for p in every}
    assert scopes == {
        ("bf16", ()),
        ("fp8_rowwise", ("routed_experts",)),
        ("fp8_rowwise", ("dense_ffn",)),
        ("fp8_rowwise", ("dense_ffn", "routed_experts")),
    }
    assert any(p.layout.fold_experts and p.layout.scope == ("dense_ffn",) for p in every)
    assert not any(p.layout.fold_experts and "routed_experts" in p.layout.scope for p in every)
    for p in every:
        if p.layout.gemm != "bf16" or p.layout.fold_experts:  # folds only bf16 experts
            continue
        dense_fp8, experts_fp8 = (
            next(
                q
                for q in every
                if q.layout == dataclasses.replace(p.layout, gemm="fp8_rowwise", scope=scope)
            )
            for scope in (("dense_ffn",), ("routed_experts",))
        )
        assert dense_fp8.step_s < p.step_s < experts_fp8.step_s
    best = search.best(1)[0]
    assert best.layout.scope == ("dense_ffn",)
    precision = best.plan(_plan()).precision
    assert precision.gemm == "fp8_rowwise" and precision.scope == ["dense_ffn"]


def test_impossible_request_is_refused(profile):
    gpu = GPUS["h100"].with_values("test", memory_bytes=profile.params)  # < 1 byte/param/rank
    with pytest.raises(NoPlanFitsError, match=r"no plan fits 2 x H100 .* smallest per-rank"):
        Search(profile, Request(2, gpu, 4 * 128, 128)).best()
    with pytest.raises(NoPlanFitsError, match="not a multiple of seq"):
        Search(profile, Request(2, GPUS["h200"], 1000, 128)).best()


@pytest.mark.slow  # the report's largest search space, timed: ~15 s of CPU by its nature
def test_largest_model_searches_in_seconds(profile):
    """A 63-unit model with many experts on 512 GPUs (the size of the report's Ultra-256E
    search space) searches in a few seconds."""
    big = profile.repeat_block(1, 63)
    assert big.num_blocks == 63
    start = time.process_time()  # this process's CPU time: other jobs on the machine do not count
    search = Search(big, Request(512, GPUS["b300"], 64 * 2**20, 8192))
    best = search.best(3)
    elapsed = time.process_time() - start
    assert best and elapsed < 20, elapsed
    assert search.evaluated > 100


def test_gpu_specs_and_probe_override(tmp_path):
    assert set(GPUS) == {"h100", "h200", "b200", "b300"}
    h200 = gpu_spec("H200")
    assert h200.bf16_tflops == 989 and h200.ceiling("bf16_tflops") == 768  # measured
    assert gpu_spec("b300").ceiling("bf16_tflops") == pytest.approx(2250 * 768 / 989)
    with pytest.raises(GPUSpecError, match="unknown GPU 'a100'; known: b200, b300, h100, h200"):
        gpu_spec("a100")
    with pytest.raises(GPUSpecError, match="no native MXFP8"):
        h200.gemm_ceiling("mxfp8")
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"device": "x", "bf16_tflops": 700.0, "hbm_gbps": 4000}))
    probed = gpu_spec("h200", probe)
    assert probed.ceiling("bf16_tflops") == 700 and probed.ceiling("hbm_gbps") == 4000
    assert probed.ceiling("fp8_tflops") == 946  # moec's measured FP8 dense-FFN rate on sm90
    assert gpu_spec("h100", {"bf16_tflops": 700.0}).ceiling("fp8_tflops") == pytest.approx(
        1979 * 700 / 989
    )  # an unmeasured FP8 rate scales with the measured bf16 one
    assert gpu_spec("b300", inter_node_gbps=50).ceiling("inter_node_gbps") == 50
    probe.write_text(json.dumps({"bf16_tflop": 1}))
    with pytest.raises(GPUSpecError, match="unknown GPU spec fields"):
        gpu_spec("h200", probe)


def test_a_cuda_device_name_finds_its_spec_the_one_home_of_the_peaks():
    """The trainer's MFU basis is the search's spec: the same table answers both."""
    assert spec_of_device("NVIDIA H200") is GPUS["h200"]
    assert spec_of_device("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert spec_of_device("NVIDIA B300 SXM6 AC").bf16_tflops == 2250
    assert spec_of_device("NVIDIA A100-SXM4-80GB") is None


def test_calibration_fits_synthetic_timings(tmp_path):
    gpu = gpu_spec("h200")
    truth = Efficiency(gemm=0.8, gemm_half_rows=300.0, memory=0.7, attention=0.4)
    samples = [
        OpSample("gemm", gemm_time(1e12, rows, gpu, "bf16", truth), flops=1e12, rows=rows)
        for rows in (128, 512, 4096, 65536)
    ]
    samples.append(OpSample("memory", 1e9 / (gpu.ceiling("hbm_gbps") * 1e9 * 0.7), nbytes=1e9))
    samples.append(OpSample("comm", 30e-6 + 1e8 / 400e9, nbytes=1e8, link_gbps=500))
    samples.append(OpSample("comm", 30e-6 + 1e9 / 400e9, nbytes=1e9, link_gbps=500))
    fitted = calibrate(samples, gpu)
    assert fitted.gemm == pytest.approx(0.8)
    assert fitted.gemm_half_rows == pytest.approx(300.0)
    assert fitted.memory == pytest.approx(0.7)
    assert fitted.latency_s == pytest.approx(30e-6) and fitted.link == pytest.approx(0.8)
    assert fitted.attention == Efficiency().attention  # no samples: kept
    path = tmp_path / "samples.json"
    path.write_text(json.dumps({"samples": [s.__dict__ for s in samples]}))
    assert calibrate(load_samples(path), gpu).gemm == pytest.approx(0.8)


def _trace_op(name, ts, dur, ext, dims, concrete=None):
    args = {"External id": ext, "Input Dims": dims}
    if concrete is not None:
        args["Concrete Inputs"] = concrete
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1,
            "tid": 1, "args": args}  # fmt: skip


def _trace_kernel(ext, dur, ts, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"External id": ext}}  # fmt: skip


def test_fa4_attention_in_a_trace_is_an_attention_sample():
    """``moec::flash_attention`` (``lowering.attention: fa4``) and its backward, whose inputs
    start with q, k, v: attention samples (backward twice the FLOPs; non-causal: whole)."""
    q = [2, 4, 16, 8]
    trace = {
        "traceEvents": [
            _trace_op("moec::flash_attention", 0, 10, 1, [q, q, q], ["", "", "", "False"]),
            _trace_kernel(1, 10.0, 0),
            _trace_op("moec::flash_attention_backward", 20, 20, 2, [q] * 6, [""] * 6 + ["True"]),
            _trace_kernel(2, 20.0, 20),
        ]
    }
    forward, backward = sorted(read_trace(trace).samples, key=lambda s: s.seconds)
    assert forward.kind == backward.kind == "attention"
    assert forward.flops == 4 * 2 * 4 * 16 * 16 * 8  # not causal
    assert backward.flops == 2 * 4 * 2 * 4 * 16 * 16 * 8 / 2  # causal


def test_samples_from_profiler_trace():
    """GEMM ops are samples with their largest dimension as rows; kernels under a grouped
    expert MLP (at any depth) count for it whole, as one GEMM of rows / experts rows; an
    attention backward counts twice its forward FLOPs (causal: half); the rest is other time,
    NCCL kernels are communication."""
    op, kernel = _trace_op, _trace_kernel

    trace = {
        "traceEvents": [
            op("aten::mm", 0, 5, 7, [[1024, 512], [512, 256]]),
            kernel(7, 100.0, 0),
            op("aten::copy_", 10, 5, 8, [[1000], [1000]]),
            kernel(8, 2.0, 150),
            op("moec::expert_mlp_backward", 20, 50, 9, [[64, 32], [4, 32, 128], [4, 64, 32]]),
            op("aten::_grouped_mm", 21, 10, 10, [[64, 32], [4, 32, 128]]),
            op("aten::silu_backward", 40, 5, 11, [[64, 64]]),
            kernel(10, 30.0, 200),
            kernel(11, 6.0, 220),  # overlaps the one before
            op(
                "aten::_scaled_dot_product_flash_attention_backward",
                100,
                20,
                12,
                [[2, 4, 16, 8], [2, 4, 16, 8], [2, 4, 16, 8]],
                [""] * 11 + ["True"],
            ),  # fmt: skip
            kernel(12, 40.0, 300),
            kernel(12, 3.0, 337, "ncclDevKernel_AllReduce"),
        ]
    }
    read = read_trace(trace)
    gemm, experts, attention = sorted(read.samples, key=lambda s: (s.kind != "gemm", -s.rows))
    assert gemm.kind == "gemm" and gemm.flops == 2 * 1024 * 512 * 256 and gemm.rows == 1024
    assert gemm.seconds == pytest.approx(100e-6)
    assert experts.flops == 2 * 2 * 64 * (32 * 128 + 64 * 32) and experts.rows == 16
    assert experts.seconds == pytest.approx(36e-6)
    assert attention.kind == "attention" and attention.seconds == pytest.approx(40e-6)
    assert attention.flops == 2 * 4 * 2 * 4 * 16 * 16 * 8 / 2
    assert read.other_s == pytest.approx(2e-6) and read.comm_s == pytest.approx(3e-6)
    assert read.busy_s == pytest.approx(172e-6) and read.span_s == pytest.approx(340e-6)
    assert samples_from_trace(trace) == read.samples
    names = {(o["name"], o["kind"]) for o in read.ops}
    assert ("aten::copy_", "memory") in names and ("moec::expert_mlp_backward", "gemm") in names


def test_collective_time_follows_each_collectives_measured_rate():
    """Each collective runs at its own share of the link (NCCL's reduce-scatter and all-gather
    slower than its all-reduce at the same bytes moved); a kind without a factor is refused."""
    eff = Efficiency(latency_s=0.0, collective_factor=(("all_reduce", 0.5), ("all_gather", 0.25)))
    link, gb = 400.0, 8e9
    # ring all-reduce over 2 ranks moves each rank's bytes once, all-gather half of them
    assert collective_time("all_reduce", gb, 2, link, eff) == pytest.approx(gb / (link * 1e9 * 0.5))
    assert collective_time("all_gather", gb, 2, link, eff) == pytest.approx(
        gb / 2 / (link * 1e9 * 0.25)
    )
    assert collective_time("all_reduce", gb, 1, link, eff) == 0.0  # one rank: nothing moves
    with pytest.raises(CalibrationError, match="no collective factor for 'reduce_scatter'"):
        collective_time("reduce_scatter", gb, 2, link, eff)


def test_efficiency_round_trips_through_json(tmp_path):
    eff = Efficiency(gemm=0.7, gemm_half_rows=250.0, memory=0.5,
                     ep_path_factor=(("rowwise", 0.5), ("sync_1d", 0.2)),
                     collective_factor=(("all_reduce", 0.4), ("all_to_all", 0.7)))  # fmt: skip
    path = tmp_path / "eff.json"
    save_efficiency(eff, path)
    assert load_efficiency(path) == eff
    path.write_text(json.dumps({"gemm": 0.8}))
    assert load_efficiency(path) == Efficiency(gemm=0.8)  # the rest: defaults
    path.write_text(json.dumps({"gemmm": 0.8}))
    with pytest.raises(CalibrationError, match="unknown Efficiency fields \\['gemmm'\\]"):
        load_efficiency(path)


def test_plan_auto_calibrates_from_a_profiled_run(tmp_path, capsys, monkeypatch, profile):
    """--calibrate RUN refits the factors from the run's ops_rank0.json (memory priced with
    the model's profile), prints them, writes them (--efficiency-out), and --efficiency reads
    them back to the same search."""
    import moec.autoplan.cli as cli

    monkeypatch.setattr(cli, "profile_of", lambda model, plan: profile)
    gpu = gpu_spec("h200")
    truth = Efficiency(gemm=0.6, gemm_half_rows=0.0, attention=0.3, memory=0.45)
    written = sum(u.other_bytes(2, 64) for u in profile.units)
    params = sum(p.numel for u in profile.units for p in u.params if p.trainable)
    nbytes = 4 * 6 * written + 2 * 28 * params  # 4 forward calls in 2 steps
    ops = {
        "world": 1, "steps": 2, "forward_calls": 4, "microbatch": [2, 64], "ops": [],
        "busy_s": 0.08, "span_s": 0.1,
        "other_s": memory_time(nbytes, gpu, truth),
        "samples": [
            {"kind": "gemm", "seconds": gemm_time(1e12, 4096, gpu, "bf16", truth),
             "flops": 1e12, "rows": 4096},
            {"kind": "attention", "seconds": 1e12 / (gpu.gemm_ceiling("bf16") * 1e12 * 0.3),
             "flops": 1e12},
        ],
    }  # fmt: skip
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    (run / "profile" / "ops_rank0.json").write_text(json.dumps(ops))
    parser = build_parser()
    common = ["plan", "auto", "--model", "llama", "--world", "2", "--gpu", "h200", "--global-batch",
              str(8 * 128), "--seq", "128", "--top", "1"]  # fmt: skip
    factors = tmp_path / "eff.json"
    args = parser.parse_args([*common, "--calibrate", str(run), "--efficiency-out", str(factors)])
    assert cmd_plan_auto(args) == 0
    text = capsys.readouterr().out
    assert "calibrated" in text and "memory 0.45 (was 0.6)" in text
    fitted = load_efficiency(factors)
    assert fitted.gemm == pytest.approx(0.6) and fitted.attention == pytest.approx(0.3)
    assert fitted.memory == pytest.approx(0.45) and fitted.device_busy == pytest.approx(0.8)
    table = text[text.index(" #  pp") :]
    assert cmd_plan_auto(parser.parse_args([*common, "--efficiency", str(factors)])) == 0
    again = capsys.readouterr().out
    assert again[again.index(" #  pp") :].split("candidates")[0] == table.split("candidates")[0]
    with pytest.raises(CalibrationError, match="no ops_rank0.json"):
        cmd_plan_auto(parser.parse_args([*common, "--calibrate", str(tmp_path)]))


def test_plan_auto_cli_writes_the_chosen_plan(tmp_path, capsys, monkeypatch, profile):
    import moec.autoplan.cli as cli

    monkeypatch.setattr(cli, "profile_of", lambda model, plan: profile)
    parser = build_parser()
    out = tmp_path / "plan.yaml"
    args = parser.parse_args(
        ["plan", "auto", "--model", "llama", "--world", "4", "--gpu", "h200", "--global-batch",
         str(32 * 128), "--seq", "128", "--top", "1", "--out", str(out)]
    )  # fmt: skip
    assert cmd_plan_auto(args) == 0
    text = capsys.readouterr().out
    assert "step ms" in text and "candidates evaluated" in text
    plan = Plan.load(out)
    assert plan.parallel.dp * plan.parallel.pp == 4
    assert plan.moe.num_experts == 8 or plan.moe.num_experts == Plan().moe.num_experts


@pytest.mark.parametrize("recompute, dp_shard", [("none", 1), ("block", 1), ("none", 2)])
def test_forced_pipeline_plan_carries_the_split_the_pass_runs(profile, recompute, dp_shard):
    """``pp`` forces the pipeline degree; a chosen plan's ``parallel.pp_layout`` is the priced
    split in the pass's units (half blocks; blocks under block recompute or FSDP), and the pass
    splits the compiled program exactly so."""
    world = 2 * dp_shard
    search = Search(profile, Request(world, GPUS["h200"], 8 * 128, 128, pp=2))
    preds = [
        p
        for p in search.candidates()
        if p.layout.recompute == recompute and p.layout.dp_shard == dp_shard and p.layout.ep == 1
    ]
    assert preds and all(p.layout.pp == 2 for p in search.candidates())
    pred = min(preds, key=lambda p: p.step_s)
    plan = pred.plan(_plan())
    assert plan.parallel.pp_layout == list(pred.pp_layout)
    assert pred.layout.whole_blocks == (recompute == "block" or dp_shard > 1)
    units = profile.num_blocks if pred.layout.whole_blocks else profile.num_units
    assert sum(pred.pp_layout) == units and profile.num_units > profile.num_blocks
    stats = _build(plan).pass_results["pipeline"].stats
    assert stats["units_per_stage"] == list(pred.pp_layout)
    with pytest.raises(NoPlanFitsError, match="pp = 3 must be a divisor"):
        Search(profile, Request(2, GPUS["h200"], 8 * 128, 128, pp=3))


@pytest.mark.parametrize("split_backward", [True, False])
def test_search_offers_only_schedules_the_runtime_runs(profile, split_backward):
    """zbv only where the plan's torch splits the backward, and never beside FSDP (the
    pipeline runtime refuses both)."""
    request = Request(4, GPUS["h200"], 16 * 128, 128, pp=2, split_backward=split_backward)
    search = Search(profile, request)
    layouts = {(p.layout.schedule, p.layout.dp_shard) for p in search.candidates()}
    assert ("zbv", 1) in layouts if split_backward else "zbv" not in {s for s, _ in layouts}
    assert not [s for s, shard in layouts if s == "zbv" and shard > 1]
    assert ("1f1b", 2) in layouts


def test_split_backward_schedule_is_refused_where_torch_cannot_run_it():
    """A torch whose autograd cannot start the weight pass at a moec op gets a PlanError naming
    the field, the installed torch and the schedules it runs, instead of a failure mid-step."""
    from moec.analysis.pipeline_schedule import check_schedule_runs

    zbv = ParallelPlan(pp=2, virtual_stages=2, pp_schedule="zbv", microbatches=4)
    with pytest.raises(PlanError, match="parallel.pp_schedule") as info:
        check_schedule_runs(zbv, split_backward=False)
    message = str(info.value)
    assert f"torch {torch.__version__}" in message and "splits each backward" in message
    assert message.endswith("accepted: gpipe, 1f1b, interleaved_1f1b")
    check_schedule_runs(zbv, split_backward=True)
    check_schedule_runs(dataclasses.replace(zbv, pp_schedule="interleaved_1f1b"), False)


def test_profile_needs_an_unpipelined_program():
    program = _build(_plan({"dp": 2, "pp": 2, "microbatches": 2}))
    with pytest.raises(ValueError, match="pp = 1"):
        profile_program(program)


def test_profile_of_a_program_with_fixed_sizes_is_refused(monkeypatch):
    """A program whose input sizes are numbers (a static capture, or a pass that specialized
    them) cannot price other microbatches: a clear error, not every size priced as the
    example's."""
    import moec.frontend

    monkeypatch.setattr(moec.frontend, "_auto_dims", lambda *args: None)
    with pytest.raises(ValueError, match="tokens per step are a number"):
        profile_program(_build(_plan()))


def test_repeating_a_unit_counts_its_flops_in_the_useful_flops(profile):
    """Useful FLOPs per token are 3x the units' forward FLOPs, before and after a unit is
    repeated to full depth (the MFU of a grown profile counts every layer)."""

    def from_units(prof, seq: int = 128) -> float:
        forward = sum(
            u.matmul_flops(1, seq) + u.attention_flops(1, seq) + u.expert_flops(1, seq)
            for u in prof.units
        )
        return 3 * forward / seq

    big = profile.repeat_block(1, profile.num_blocks + 5)
    for prof in (profile, big):
        assert prof.useful_flops_per_token(1, 128) == pytest.approx(from_units(prof))
    assert big.useful_flops_per_token(1, 128) > profile.useful_flops_per_token(1, 128)


@pytest.mark.slow
def test_autoplan_validate_small_runs_on_the_cpu(tmp_path, capsys):
    """benchmarks/autoplan_validate.py --small: the search's plans and the fitting examples are
    trained, predicted vs measured printed, the calibration from a profiled step of the
    one-GPU plan printed beside it, and the JSON written."""
    from benchmarks.autoplan_validate import main

    out = tmp_path / "result.json"
    args = ["--small", "--top", "1", "--steps", "1", "--warmup", "1", "--calibrate"]
    assert main([*args, "--out", str(tmp_path / "runs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "calibrated from" in text and "pred/meas" in text and "cal/meas" in text
    assert "chosen is fastest:" in text
    data = json.loads(out.read_text())
    names = {source for plan in data["plans"] for source in plan["sources"]}
    assert "search #1" in names and "profiling_workload.yaml" in names
    assert all("step_s" in plan for plan in data["plans"]), data["plans"]
    assert data["calibrated_efficiency"]["gemm"] != Efficiency().gemm


@pytest.mark.slow
def test_table49_script_plans_a_row(tmp_path):
    """benchmarks/autoplan_table49.py --rows tiny: the Tiny-64E model built to the report's
    parameter counts, grown to full depth, its report layout evaluated and the search's plan
    fitting a B300 (the script broke unseen once when the profile's units changed)."""
    from benchmarks.autoplan_table49 import main

    out = tmp_path / "t49.json"
    main(["--rows", "tiny", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    chosen = row["chosen"][0]
    assert row["row"]["config"] == "Tiny-64E, no EP" and row["report_layout"]
    assert 0 < chosen["memory_gib"] < 0.92 * GPUS["b300"].memory_bytes / 2**30
    assert chosen["step_s"] <= row["best_bf16"]["step_s"]
