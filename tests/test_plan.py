import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import moec
from moec.models import Llama, LlamaConfig
from moec.passes.manager import pipeline_string
from moec.plan import REMOVED_FIELDS, Plan, PlanError


@pytest.mark.parametrize(
    "data, field",
    [
        ({"moe": {"top_k": 9, "num_experts": 8}}, "moe.top_k"),
        ({"moe": {"top_k": 0}}, "moe.top_k"),
        ({"moe": {"num_experts": 0}}, "moe.num_experts"),
        ({"moe": {"capacity_factor": 0}}, "moe.capacity_factor"),
        ({"moe": {"capacity_factor": -1.0}}, "moe.capacity_factor"),
        ({"moe": {"capacity_factor": float("inf")}}, "moe.capacity_factor"),
        ({"moe": {"dense_first": -1}}, "moe.dense_first"),
        ({"moe": {"init": "copy"}}, "moe.init"),
        ({"moe": {"gating": "relu"}}, "moe.gating"),
        ({"moe": {"lbl_coef": -0.1}}, "moe.lbl_coef"),
        ({"moe": {"expert_width": 0}}, "moe.expert_width"),
        ({"moe": {"num_experts": "8"}}, "moe.num_experts"),
        ({"moe": {"normalize_weights": 1}}, "moe.normalize_weights"),
        ({"moe": {"num_experts": 6}, "parallel": {"ep": 4, "dp": 4}}, "parallel.ep"),
        ({"parallel": {"ep": 2, "dp": 1}}, "parallel.ep"),
        ({"parallel": {"pp": 0}}, "parallel.pp"),
        ({"parallel": {"pp": 4, "microbatches": 2}}, "parallel.microbatches"),
        ({"parallel": {"pp_schedule": "zbv", "virtual_stages": 1}}, "parallel.virtual_stages"),
        ({"parallel": {"ep_path": "nvshmem"}}, "parallel.ep_path"),
        ({"precision": {"gemm": "fp4"}}, "precision.gemm"),
        ({"precision": {"scope": ["mlp"]}}, "precision.scope"),
        ({"recompute": {"policy": "budget"}}, "recompute.budget_bytes"),
        ({"recompute": {"policy": "all"}}, "recompute.policy"),
        ({"moe": {"experts": 8}}, "moe.experts"),
        ({"moe": {"ffn_dropout": "keep"}}, "moe.ffn_dropout"),
        ({"lowering": {"attention": "fa3"}}, "lowering.attention"),
        ({"lowering": {"attention": "cudnn"}}, "lowering.attention"),  # a benchmark baseline
        ({"lowering": {"gather_up": True}}, "lowering.gather_up"),  # removed: no measured gain
        ({"moe": {"activations": ["mish"]}}, "moe.activations"),
        ({"moe": {"activations": {"mish": 3}}}, "moe.activations"),
        ({"moe": {"activations": {"mish": "math"}}}, "moe.activations.mish"),
        ({"moe": {"activations": {"mish": "math:"}}}, "moe.activations.mish"),
        ({"moes": {}}, "plan.moes"),
    ],
)
def test_bad_plan_names_field(data, field):
    with pytest.raises(PlanError) as info:
        Plan.from_dict(data)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("text", ["moe: []", "moe: 0", "parallel: false", "lowering: fast"])
def test_a_section_of_the_wrong_type_names_it_and_its_fields(tmp_path, text):
    """Before: each silently became the default plan."""
    path = tmp_path / "plan.yaml"
    path.write_text(text + "\n")
    section = text.split(":")[0]
    with pytest.raises(PlanError, match=rf"'{section}' = .* a mapping of its fields \(") as info:
        Plan.load(path)
    assert info.value.field == section


def test_an_empty_section_is_its_defaults(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("moe:\nparallel: {}\n")
    assert Plan.load(path) == Plan()


def test_yaml_round_trip(tmp_path):
    plan = Plan.from_dict(
        {
            "moe": {"num_experts": 32, "top_k": 8, "capacity_factor": None, "shared_expert": True},
            "parallel": {"dp": 8, "ep": 8},
            "recompute": {"policy": "budget", "budget_bytes": 10},
        }
    )
    plan.save(tmp_path / "p.yaml")
    again = Plan.load(tmp_path / "p.yaml")
    assert again == plan
    assert "expert_parallel{ep=8" in pipeline_string(again)


def test_activations_round_trip_through_yaml(tmp_path):
    (tmp_path / "acts.py").write_text(
        "import torch\n\ndef mish(x):\n    return x * torch.tanh(x)\n"
    )
    activations = {"mish": f"{tmp_path / 'acts.py'}:mish", "erf": "torch:erf"}
    plan = Plan.from_dict({"moe": {"activations": activations, "ffn_dropout": "drop"}})
    plan.save(tmp_path / "p.yaml")
    assert Plan.load(tmp_path / "p.yaml") == plan


@pytest.mark.parametrize(
    "ref", ["no_such_module_for_moec:mish", "math:pi", "math:no_such_function", "nowhere.py:f"]
)
def test_an_activation_that_does_not_load_names_the_plan_field_when_compiled(ref):
    plan = Plan.from_dict({"moe": {"activations": {"mish": ref}}})  # its form is valid
    with pytest.raises(PlanError) as info:
        moec.compile(_MODEL, plan, (_TOKENS,))
    assert info.value.field == "moe.activations.mish"


def test_a_plan_that_is_read_runs_no_code_it_names(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "acts.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n\ndef f(x):\n    return x\n"
    )
    data = {"moe": {"activations": {"mine": f"{tmp_path / 'acts.py'}:f"}}}
    Plan.from_dict(data).save(tmp_path / "p.yaml")
    Plan.load(tmp_path / "p.yaml")
    assert not marker.exists()
    moec.compile(_MODEL, Plan.from_dict(data), (_TOKENS,))  # compiled: its code is loaded
    assert marker.exists()


def test_a_registered_activation_that_is_not_elementwise_names_the_plan_field():
    plan = {"moe": {"activations": {"rownorm": "torch.nn.functional:normalize"}}}
    with pytest.raises(PlanError, match="moe.activations.rownorm.*not elementwise") as info:
        moec.compile(_MODEL, plan, (_TOKENS,))
    assert info.value.field == "moe.activations.rownorm"


def test_bad_yaml_file(tmp_path):
    (tmp_path / "p.yaml").write_text("- just\n- a list\n")
    with pytest.raises(PlanError, match="plan file .*p.yaml"):
        Plan.load(tmp_path / "p.yaml")


def test_dense_first_checked_against_the_model():
    model = Llama(LlamaConfig(dim=32, n_layers=2, ffn_hidden=64, n_heads=2, n_kv_heads=1))
    tokens = torch.randint(0, 256, (2, 8))
    with pytest.raises(PlanError) as info:
        moec.compile(model, {"moe": {"dense_first": 2}}, (tokens,))
    assert info.value.field == "moe.dense_first"


_MODEL = Llama(LlamaConfig(dim=32, n_layers=2, ffn_hidden=64, n_heads=2, n_kv_heads=1))
_TOKENS = torch.randint(0, 256, (2, 8))


@settings(max_examples=25, deadline=None)
@given(
    num_experts=st.integers(-1, 10),
    top_k=st.integers(-1, 10),
    capacity_factor=st.one_of(st.none(), st.floats(-1, 3), st.just(float("nan"))),
    dense_first=st.integers(-1, 3),
    init=st.sampled_from(["upcycle", "split", "random", "bogus"]),
    expert_width=st.one_of(st.none(), st.sampled_from([0, 8, 16, 64])),
    shared=st.booleans(),
)
def test_random_plans_compile_or_raise_plan_error(
    num_experts, top_k, capacity_factor, dense_first, init, expert_width, shared
):
    data = {
        "moe": {
            "num_experts": num_experts,
            "top_k": top_k,
            "capacity_factor": capacity_factor,
            "dense_first": dense_first,
            "init": init,
            "expert_width": expert_width,
            "shared_expert": shared,
        }
    }
    try:
        plan = Plan.from_dict(data)
        compiled = moec.compile(_MODEL, plan, (_TOKENS,))
    except PlanError as err:
        assert err.field.startswith("moe.")
        return
    out = compiled(_TOKENS)
    assert out.shape == (2, 8, 256) and torch.isfinite(out).all()


OLD_PLAN = {  # a plan as moec wrote it before the removals, every removed field at its default
    "moe": {"num_experts": 8, "routing": "learned"},
    "parallel": {"ep_path": "auto"},
    "lowering": {"cuda_graph": False, "shared_expert_stream": False, "regions": "whole"},
}


@pytest.mark.parametrize(
    "field, value, instead",
    [
        *((name, "x", None) for name in REMOVED_FIELDS),
        ("lowering.cuda_graph", True, "experimental.cuda_graph"),
        ("parallel.ep_path", "sync_1d", "'rowwise' or 'a2a_capacity'"),
    ],
)
def test_an_old_plan_file_naming_a_removed_field_is_refused_in_one_line(
    tmp_path, field, value, instead
):
    """Before: an unknown field's error listed the known ones, and said nothing of the move."""
    section, name = field.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {name: value}}))
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    message = str(info.value)
    assert info.value.field == field and "\n" not in message
    assert f"'{field}'" in message and "removed from the plan" in message
    assert instead is None or instead in message


def test_an_old_plan_at_its_defaults_is_refused_too():
    """Not a silent ignore: a removed field is an error even at the value it used to default to."""
    with pytest.raises(PlanError, match="removed from the plan") as info:
        Plan.from_dict(OLD_PLAN)
    assert info.value.field in REMOVED_FIELDS


def test_the_experimental_section_round_trips_and_holds_only_expert_options(tmp_path):
    plan = Plan.from_dict({"experimental": {"cuda_graph": True}})
    plan.save(tmp_path / "p.yaml")
    assert Plan.load(tmp_path / "p.yaml").experimental.cuda_graph
    assert {f.name for f in dataclasses.fields(plan.experimental)} == {"cuda_graph"}
    assert not Plan().experimental.cuda_graph  # nothing experimental is on by default
    with pytest.raises(PlanError, match="experimental.gather_up"):
        Plan.from_dict({"experimental": {"gather_up": True}})


def test_the_readme_plan_names_every_field_and_is_valid():
    """The README's plan block is a valid plan holding every field of every section (the docs
    cannot silently fall behind the plan)."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    start = text.index("```yaml\nmoe:") + len("```yaml\n")
    block = yaml.safe_load(text[start : text.index("```", start)])
    moec.Plan.from_dict(block)
    plan = moec.Plan()
    for section in dataclasses.fields(plan):
        section = section.name
        fields = {f.name for f in dataclasses.fields(getattr(plan, section))}
        assert set(block[section]) == fields, (section, fields ^ set(block[section]))
