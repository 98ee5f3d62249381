"""Every plan in ``examples/plans`` trains the model the README names for it, with the README's
command, on the CPU for a few steps; where a plan does not fit a model the error says what the
plan needs, what the model has and what to change; a fixed ``expert_width`` wider than the
model's FFN is warned about."""

import re
import warnings
from pathlib import Path

import pytest
import torch

import moec
from moec.models import Llama, LlamaConfig
from moec.models.zoo import load_model
from moec.plan import Plan, PlanError
from moec.train import DEMO_PLAN, TrainConfig, Trainer
from tests.distributed import spawn
from tests.models import tiny_llama, tokens

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "examples" / "plans"
CPU_EP_PATH = "parallel.ep_path: a2a_capacity"
"""What an example on the CUDA-only rowwise path says to set on CPUs (gloo)."""


def readme_commands() -> dict[str, tuple[str, int]]:
    """plan file name -> (model, processes) of the README's example-plan commands."""
    text = (ROOT / "README.md").read_text()
    pattern = (
        r"`(?:torchrun --nproc-per-node (\d+) -m )?moec train --model (\S+) "
        r"--plan examples/plans/([\w.]+)`"
    )
    return {plan: (model, int(world or 1)) for world, model, plan in re.findall(pattern, text)}


COMMANDS = readme_commands()


def _cfg(out: Path, world: int) -> TrainConfig:
    return TrainConfig(
        steps=3,
        batch_size=2 * world,
        seq_len=32,
        warmup_steps=1,
        log_every=1,
        out=str(out),
        plots=False,
        device="cpu",
    )


def test_the_readme_names_a_model_for_every_example_plan():
    assert sorted(COMMANDS) == sorted(p.name for p in PLANS.glob("*.yaml"))


def test_demo_yaml_is_the_plan_moec_demo_uses():
    assert Plan.load(PLANS / "demo.yaml").to_dict() == Plan.from_dict(DEMO_PLAN).to_dict()


ONE_PROCESS = [name for name, (_, world) in sorted(COMMANDS.items()) if world == 1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ONE_PROCESS)
def test_a_one_process_example_plan_trains_its_readme_model(name, tmp_path):
    model, _ = COMMANDS[name]
    torch.manual_seed(0)
    trainer = Trainer(load_model(model)[0], Plan.load(PLANS / name), _cfg(tmp_path, 1))
    result = trainer.run()
    assert len(result.losses) == 3 and all(map(torch.isfinite, torch.tensor(result.losses)))
    assert trainer.compiled.moe_layers


def _rank(rank: int, world: int, out: str, name: str, model: str) -> None:
    torch.manual_seed(0)  # the same dense init on every rank
    plan = Plan.load(PLANS / name)
    plan.parallel.ep_path = "a2a_capacity"  # the example's CPU setting (CPU_EP_PATH)
    result = Trainer(load_model(model)[0], plan, _cfg(Path(out), world)).run()
    assert len(result.losses) == 3 and all(map(torch.isfinite, torch.tensor(result.losses)))


@pytest.mark.slow
def test_the_ep8_example_trains_on_eight_gloo_ranks(tmp_path):
    """ep8_rowwise.yaml, with the path its comment names for CPUs (rowwise needs CUDA)."""
    name = "ep8_rowwise.yaml"
    model, world = COMMANDS[name]
    assert world == 8 and CPU_EP_PATH in (PLANS / name).read_text()
    spawn(_rank, world, str(tmp_path), name, model)
    assert (tmp_path / "checkpoints" / "step_3").is_dir()


@pytest.mark.slow
def test_the_pipelined_example_trains_its_readme_model_on_eight_gloo_ranks(tmp_path):
    """pp2_ep4_mxfp8_recompute.yaml (PP = 2 x DP = 4 x EP = 4, MXFP8 emulated on the CPU, block
    recompute) trains the README's model on its ``dp x pp`` = 8 ranks."""
    name = "pp2_ep4_mxfp8_recompute.yaml"
    model, world = COMMANDS[name]
    p = Plan.load(PLANS / name).parallel
    assert world == 8 == p.dp * p.pp
    spawn(_rank, world, str(tmp_path), name, model)
    assert (tmp_path / "checkpoints" / "step_3").is_dir()


# --- errors from the user's side ------------------------------------------------------------------


def test_dense_first_beyond_the_model_says_what_the_plan_needs_and_the_model_has():
    plan = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 2}}
    with pytest.raises(PlanError) as caught:
        moec.compile(tiny_llama(layers=2), plan, (tokens(),))
    message = str(caught.value)
    assert "keeps the first 2 FFN blocks dense and needs at least one more" in message
    assert "the model has 2 (layers.0.ffn, layers.1.ffn)" in message
    assert "set moe.dense_first to at most 1" in message


def test_an_expert_width_the_init_cannot_give_names_the_width_it_gives():
    plan = {"moe": {"num_experts": 4, "top_k": 2, "init": "upcycle", "expert_width": 32}}
    with pytest.raises(PlanError) as caught:
        moec.compile(tiny_llama(), plan, (tokens(),))
    message = str(caught.value)
    assert "init='upcycle' reads the dense FFN (64 wide) and copies it whole into" in message
    assert "each expert of FFN layers.0.ffn is 64 wide" in message
    assert "leave moe.expert_width unset" in message


def _moe_warnings(model: torch.nn.Module, plan: dict, args: tuple) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moec.compile(model, plan, args)
    return [str(w.message) for w in caught if "expert_width" in str(w.message)]


def test_an_expert_width_wider_than_the_models_ffn_is_warned_about():
    """demo.yaml's 256 halves llama's FFN (512); on a model whose FFN is 64 wide it is 4x."""
    plan = Plan.load(PLANS / "demo.yaml").to_dict()
    (said,) = _moe_warnings(tiny_llama(2), plan, (tokens(),))  # layer 0 dense, layer 1 MoE
    assert "moe.expert_width = 256 makes each routed expert wider than the dense FFN" in said
    assert "(64 wide in layers.1.ffn, 4x)" in said
    as_wide_as_llama = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, ffn_hidden=512))
    assert _moe_warnings(as_wide_as_llama, plan, (tokens(),)) == []
    unset = {"moe": {k: v for k, v in plan["moe"].items() if k != "expert_width"}}
    compiled = moec.compile(tiny_llama(2), unset, (tokens(),))  # experts as wide as the FFN
    assert compiled.graph_module.get_parameter("layers.1.ffn.moe.w_down").shape[1] == 64
