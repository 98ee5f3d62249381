"""Errors a user makes every day reach the ``moec`` command line as one line and exit code 2."""

import textwrap

import pytest
import torch

import moec
from moec.cli import main
from moec.errors import MoecError
from moec.passes.expert_parallel import ExpertParallelError
from tests.models import tiny_llama, tokens
from tests.test_structure import fresh_activations  # noqa: F401  (a fixture)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _error_line(capsys) -> str:
    """The one line ``moec`` wrote to stderr (asserting it is one line)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("moec: error: ")
    return lines[0]


def _model_file(tmp_path, body: str) -> str:
    """A ``file.py:make`` model spec whose ``make()`` returns (model, example_inputs)."""
    path = tmp_path / "user_model.py"
    path.write_text("import torch\nfrom torch import nn\n\n" + textwrap.dedent(body))
    return f"{path}:make"


ATTENTION_ONLY = """
class AttentionOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.out(nn.functional.scaled_dot_product_attention(q, k, v))


def make():
    return AttentionOnly(), (torch.randn(2, 8, 16),)
"""

TANH_FFN = """
class TanhFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def make():
    return TanhFFN(), (torch.randn(2, 8, 16),)
"""


def test_model_without_ffn_is_one_line_naming_the_model_and_what_was_looked_for(tmp_path, capsys):
    spec = _model_file(tmp_path, ATTENTION_ONLY)
    assert main(["debug", spec, "--no-loss", "--out", str(tmp_path / "dbg")]) == 2
    line = _error_line(capsys)
    assert "no FFN region found in AttentionOnly" in line
    assert "linear (or pointwise conv) -> activation -> linear" in line
    assert "moec inspect" in line


def test_unrecognised_activation_lists_the_supported_ones_and_how_to_register(tmp_path, capsys):
    spec = _model_file(tmp_path, TANH_FFN)
    assert main(["debug", spec, "--no-loss", "--out", str(tmp_path / "dbg")]) == 2
    line = _error_line(capsys)
    assert "down: activation not recognised" in line
    assert "quick_gelu" in line and "relu2" in line and "swiglu" in line
    assert "moec.register_activation(name, fn)" in line and "moe.activations" in line


@pytest.mark.usefixtures("fresh_activations")
def test_plan_activation_makes_the_unrecognised_ffn_convert(tmp_path):
    spec = _model_file(tmp_path, TANH_FFN)
    (tmp_path / "acts.py").write_text("import torch\n\ndef tanh(x):\n    return torch.tanh(x)\n")
    plan = tmp_path / "plan.yaml"
    acts = f"{tmp_path}/acts.py:tanh"
    plan.write_text(f"moe:\n  num_experts: 2\n  activations:\n    tanh_act: {acts}\n")
    argv = ["debug", spec, "--no-loss", "--plan", str(plan), "--out", str(tmp_path / "dbg")]
    assert main(argv) == 0


@pytest.mark.parametrize("command", ["debug", "train"])
def test_binary_plan_file_is_named(tmp_path, capsys, command):
    plan = tmp_path / "plan.bin"
    plan.write_bytes(bytes(range(256)) * 4)
    out = str(tmp_path / "out")
    args = ["debug", "llama", "--plan", str(plan), "--out", out]
    if command == "train":
        args = ["train", "--plan", str(plan), "--steps", "1", "--synthetic", "--out", out]
    assert main(args) == 2
    line = _error_line(capsys)
    assert f"plan file '{plan}' is invalid" in line and "not binary" in line


def test_non_yaml_plan_file_is_one_line(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("moe: {num_experts: [4\n  top_k: 2\n")
    assert main(["plan", "show", str(plan)]) == 2
    assert f"plan file '{plan}' is invalid: valid YAML" in _error_line(capsys)


def test_expert_parallel_without_torchrun_says_how_to_launch(tmp_path, capsys, monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    plan = tmp_path / "ep.yaml"
    plan.write_text("moe: {num_experts: 4}\nparallel: {dp: 2, ep: 2}\n")
    args = ["train", "--plan", str(plan), "--steps", "1", "--synthetic"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "not started by torchrun" in line
    assert "`torchrun --nproc-per-node 2 -m moec train ...`" in line


def test_compile_of_an_expert_parallel_plan_without_a_mesh_says_how_to_launch():
    plan = {"moe": {"num_experts": 4}, "parallel": {"dp": 2, "ep": 2}}
    with pytest.raises(ExpertParallelError, match="torchrun --nproc-per-node 2"):
        moec.compile(tiny_llama(layers=1), plan, (tokens(),))


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--steps", "0"], "--steps"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--warmup-steps", "-1"], "--warmup-steps"),
        (["--weight-decay", "-0.1"], "--weight-decay"),
    ],
)
def test_bad_train_flags_are_one_line(tmp_path, capsys, flags, named):
    args = ["train", "--steps", "1", "--synthetic", "--out", str(tmp_path / "run")]
    assert main([*args, *flags]) == 2
    assert named in _error_line(capsys)


@pytest.mark.parametrize("field, value", [("min_lr_ratio", 1.5), ("decay_fraction", -0.1)])
def test_schedule_fractions_out_of_range_name_the_field(field, value):
    from moec.train.config import TrainConfig, TrainConfigError

    with pytest.raises(
        TrainConfigError,
        match=rf"TrainConfig\.{field} \(--{field.replace('_', '-')}\) = {value}: must be in",
    ):
        TrainConfig(**{field: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_a_gpu_is_one_line(tmp_path, capsys):
    args = ["train", "--steps", "1", "--synthetic", "--device", "cuda"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    assert "CUDA is not available" in _error_line(capsys)


@pytest.mark.parametrize("where", ["before the command", "after it"])
def test_debug_flag_prints_the_traceback(tmp_path, capsys, where):
    plan = tmp_path / "plan.yaml"
    plan.write_text("moe: {top_k: 0}\n")
    words = ["plan", "show", str(plan)]
    assert main(["--debug", *words] if where == "before the command" else [*words, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("moec: error: plan field 'moe.top_k'")


def test_user_facing_error_classes_are_moec_errors():
    from moec.frontend import CaptureError
    from moec.models.zoo import ModelSpecError
    from moec.ops.activations import ActivationError
    from moec.ops.ep import EPPathError
    from moec.passes.moe import MoEPassError
    from moec.passes.pipeline import PipelinePassError
    from moec.passes.verify import VerificationError
    from moec.plan import PlanError
    from moec.runtime.distributed import DistributedError

    user = (CaptureError, ModelSpecError, ActivationError, EPPathError, MoEPassError)
    user += (PipelinePassError, PlanError, DistributedError, ExpertParallelError)
    assert all(issubclass(cls, MoecError) and cls.exit_code == 2 for cls in user)
    assert not issubclass(VerificationError, MoecError)  # a broken pass invariant is a bug
