"""``moec.kernels.target.Target``: detected for a device by default, given to ``moec.compile``
otherwise; the program records it and binds every ``moec::`` node for it (pass ``bind``)."""

from __future__ import annotations

import copy
import dataclasses

import torch

import moec
from moec.frontend import capture
from moec.kernels.arch import HAVE_TRITON, interpreting
from moec.kernels.target import Target, count_text
from moec.passes.base import PassContext
from moec.plan import Plan
from tests.models import tiny_llama, tokens

PLAN = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1}}
HOPPER = Target(device="cuda", arch="sm90", triton=True, quack=True, fa4=True)


def test_the_cpu_target_runs_no_gpu_backend():
    target = Target.detect("cpu")
    assert (target.device, target.arch) == ("cpu", "interpreter")
    assert target.triton == (HAVE_TRITON and interpreting())
    assert not (target.quack or target.fa4) and target.native_recipe is None
    assert target.describe().startswith("cpu interpreter")


def _impls(compiled) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for module in compiled.program.graph.modules():
        for node in getattr(module, "graph", torch.fx.Graph()).nodes:
            if "impl" in node.kwargs:
                found.setdefault(node.target._schema.name, set()).add(node.kwargs["impl"])
    return found


def test_compile_binds_for_the_target_it_is_given_and_records_it():
    """A program bound for a Hopper target (kernels, the CuTe DSL rules) on this CPU: every node
    names its kernels implementation, the program records the target and each binding, and the
    values equal the program bound for the detected CPU target (the kernels take no CPU tensor,
    so each implementation runs its reference)."""
    torch.manual_seed(0)
    model, ids = tiny_llama(layers=2), tokens(batch=2, seq=16)
    detected = moec.compile(copy.deepcopy(model), PLAN, (ids,))
    hopper = moec.compile(copy.deepcopy(model), PLAN, (ids,), target=HOPPER)
    assert detected.program.target == Target.detect("cpu")
    assert hopper.program.target == HOPPER
    assert _impls(hopper)["moec::expert_mlp"] == {"kernels:rules+quack"}
    assert _impls(hopper)["moec::route"] == {"triton"}
    assert set().union(*_impls(detected).values()) == {"reference"}
    names = {name for name in hopper.program.bindings}
    assert len(names) == hopper.pass_results["bind"].stats["bound"] > 0
    torch.testing.assert_close(hopper(ids), detected(ids))


def test_a_pass_reads_the_programs_target_from_its_context():
    """``PassContext.target`` is the program's target; the detected CPU target where the
    program records none or the pass runs on a bare graph."""
    program = capture(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    assert PassContext(Plan(), program).target == Target.detect("cpu")
    program.target = HOPPER
    assert PassContext(Plan(), program).target == HOPPER
    assert PassContext(Plan()).target == Target.detect("cpu")


def test_element_counts_read_exactly_in_the_largest_binary_unit_that_divides_them():
    assert [count_text(n) for n in (2**30, 3 << 20, 1 << 14, 2**40 * 5)] == [
        "1 Gi", "3 Mi", "16 Ki", "5 Ti"
    ]  # fmt: skip
    assert [count_text(n) for n in (0, 512, 1536, 1_000_000)] == ["0", "512", "1,536", "1,000,000"]
    small = dataclasses.replace(Target(), loss_chunk_elements=1 << 14)
    assert "loss chunks of 16 Ki logits" in small.describe()


def test_the_target_resolves_ep_path_auto_and_supplies_op_arguments():
    """``ep_path: auto``: rowwise on CUDA, a2a_capacity elsewhere (a plan-only check allows for
    both); split exchanges run asynchronously on CUDA unless the target says otherwise."""
    cpu, cuda = Target(), Target(device="cuda")
    assert (cpu.ep_path("auto"), cuda.ep_path("auto")) == ("a2a_capacity", "rowwise")
    assert cuda.ep_path("sync_1d") == "sync_1d" and Target.ep_paths("sync_1d") == ("sync_1d",)
    assert set(Target.ep_paths("auto")) == {"rowwise", "a2a_capacity"}
    assert cpu.op_arguments() == {
        "poison": None, "asynchronous": False, "copy_programs": None, "chunk_elements": 2**30
    }  # fmt: skip
    assert cuda.op_arguments()["asynchronous"] is True
    tested = dataclasses.replace(cpu, ep_poison=-1.0, ep_asynchronous=True)
    assert tested.op_arguments()["poison"] == -1.0 and tested.op_arguments()["asynchronous"]
    assert "EP buffers poisoned with -1.0" in tested.describe()
