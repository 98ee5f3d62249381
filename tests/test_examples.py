"""The example plans load and the example model factories work through the CLI."""

from pathlib import Path

import pytest

from moec.cli import main
from moec.plan import Plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("path", sorted((EXAMPLES / "plans").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_plan_loads(path):
    plan = Plan.load(path)
    assert plan.moe.num_experts % plan.parallel.ep == 0


def test_example_factory_through_the_cli(capsys):
    assert main(["inspect", f"{EXAMPLES / 'models.py'}:small_gpt2"]) == 0
    assert "gelu_tanh" in capsys.readouterr().out
