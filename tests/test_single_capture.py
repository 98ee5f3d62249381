"""One capture to the first step (issue #53): ``moec.compile(model, ..., check=...)`` and the
Trainer under a memory limit build the program once, on the meta device, check it and
materialize it from the model's own tensors (:class:`moec.runtime.materialize.ModuleSource`).
The program is the one the build without a check makes: the same values, losses and gradients
bit for bit, the same tensors shared with the user's model, and the model left as it was."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import transformers as tf
from torch import nn

import moec
from moec.compiler import meta_program, single_build_blocker
from moec.models import Llama, LlamaConfig
from moec.passes.casts import _device_type
from moec.plan import Plan
from moec.train import LanguageModelWithLoss, TrainConfig, Trainer
from tests.distributed import spawn
from tests.models import hf_model, tiny_llama

UPCYCLE = {"moe": {"num_experts": 4, "top_k": 2, "shared_expert": True}}
DROP_BF16 = {
    "moe": {"num_experts": 4, "top_k": 2, "init": "drop_upcycle"},
    "precision": {"compute_dtype": "bf16"},
}
RANDOM = {"moe": {"num_experts": 4, "top_k": 2, "init": "random", "dense_first": 0}}


@contextlib.contextmanager
def exports() -> Iterator[list[int]]:
    """The number of ``torch.export.export`` calls made in the block (in a one-item list)."""
    count, export = [0], torch.export.export

    def counted(*args, **kwargs):
        count[0] += 1
        return export(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "export", counted)
        yield count


def tokens(batch: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (batch, seq + 1))
    return ids[:, :-1], ids[:, 1:]


def tied_llama() -> nn.Module:
    return LanguageModelWithLoss(
        Llama(
            LlamaConfig(
                dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, tie_embeddings=True
            )
        )
    )


def tied_hf_llama() -> nn.Module:
    """A transformers Llama whose head shares the embedding, with a non-persistent rotary
    ``inv_freq`` buffer."""
    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        tie_word_embeddings=True,
    )
    return LanguageModelWithLoss(tf.LlamaForCausalLM(cfg))


class BatchNormNet(nn.Module):
    """Embedding, batch norm (running statistics: captured in training mode), a GELU FFN and a
    head, with its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.norm = nn.BatchNorm1d(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        x = x + self.down(nn.functional.gelu(self.up(x)))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class MadeConstant(nn.Module):
    """A forward that makes a tensor on its inputs' device from Python numbers: captured on
    the meta device, the constant has no value."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * torch.tensor([0.5] * 16, device=ids.device)
        x = x + self.down(nn.functional.gelu(self.up(x)))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _unchanged(model: nn.Module) -> Callable[[], bool]:
    """Whether ``model``'s state is still the objects and values it holds now."""
    before = [(n, t, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()]

    def unchanged() -> bool:
        after = model.state_dict(keep_vars=True)
        return all(after[n] is t and torch.equal(t, value) for n, t, value in before)

    return unchanged


def _shared(compiled: moec.CompiledModel, model: nn.Module) -> set[str]:
    """The names of the compiled model's parameters and buffers that are ``model``'s objects."""
    own = {id(t) for t in [*model.parameters(), *model.buffers()]}
    named = [*compiled.named_parameters(), *compiled.named_buffers()]
    return {name for name, t in named if id(t) in own}


def _loss_and_grads(compiled: moec.CompiledModel, args: tuple) -> list[torch.Tensor]:
    loss = compiled(*args)
    params = [p for p in compiled.parameters() if p.requires_grad]
    return [loss, *torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)]


def _compare(make: Callable[[], nn.Module], plan: dict, args: tuple, captures: int = 1) -> None:
    """Compile two copies of one model, without and with a check: the checked build captures
    ``captures`` times; both programs hold the same values, share the same tensors with their
    models, leave their models as they were (before: the verifier's fake propagation ran a
    batch norm's ``num_batches_tracked += 1`` on the model's tensor), and give the same loss
    and gradients bit for bit (the buffers' updates in a training forward too)."""
    torch.manual_seed(0)
    plain_model = make()
    checked_model = copy.deepcopy(plain_model)
    untouched = [_unchanged(plain_model), _unchanged(checked_model)]
    plain = moec.compile(plain_model, plan, args)
    seen = []
    with exports() as count:
        checked = moec.compile(checked_model, plan, args, check=seen.append)
    assert count[0] == captures and len(seen) == 1
    assert all(unchanged() for unchanged in untouched)
    assert _shared(checked, checked_model) == _shared(plain, plain_model)
    assert _shared(plain, plain_model)  # the programs do share the models' tensors
    mine, theirs = checked.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert mine[name].dtype == theirs[name].dtype, name
        assert mine[name].stride() == theirs[name].stride(), name
        assert torch.equal(mine[name], theirs[name]), name
    for got, want in zip(_loss_and_grads(checked, args), _loss_and_grads(plain, args), strict=True):
        assert torch.equal(got, want)
    mine, theirs = checked.state_dict(), plain.state_dict()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)  # buffers' updates


@pytest.mark.parametrize(
    "make,plan",
    [
        (tied_llama, UPCYCLE),
        (tied_llama, DROP_BF16),
        (tied_hf_llama, RANDOM),
        (tied_hf_llama, DROP_BF16),
        (BatchNormNet, RANDOM),
    ],
    ids=["llama-upcycle-fp32", "llama-drop-bf16", "hf-llama-random", "hf-llama-bf16", "batchnorm"],
)
def test_a_checked_compile_captures_once_and_builds_the_same_program(make, plan):
    """Before: the checked compile captured twice (the meta build, then the real one)."""
    _compare(make, plan, tokens())


def test_a_constant_made_on_the_inputs_device_keeps_the_second_build():
    args = tokens()
    program = meta_program(MadeConstant(), Plan.from_dict(RANDOM), args, {})
    assert "lifted_tensor" in single_build_blocker(program)
    _compare(MadeConstant, RANDOM, args, captures=2)


def test_a_pipelined_program_without_a_pipeline_mesh_is_built_once_whole():
    """Every stage is materialized (no pipeline rank to pick one): the full graph runs."""
    plan = {**RANDOM, "parallel": {"pp": 2, "microbatches": 2}}
    _compare(lambda: LanguageModelWithLoss(tiny_llama(2)), plan, tokens())


def test_a_meta_model_from_a_dense_checkpoint_is_checked_and_built_once():
    args = tokens()
    on_meta = tuple(t.to("meta") for t in args)  # the Trainer's capture of a meta model
    torch.manual_seed(0)
    dense = LanguageModelWithLoss(hf_model("llama")).state_dict()
    with torch.device("meta"):
        meta = LanguageModelWithLoss(hf_model("llama"))
    plain = moec.compile(meta, DROP_BF16, on_meta, init_from=dense)
    checked_meta = []

    def check(program) -> None:
        checked_meta.append(all(p.is_meta for p in program.graph.parameters()))

    with exports() as count:
        checked = moec.compile(meta, DROP_BF16, on_meta, init_from=dense, check=check)
    assert count[0] == 1 and checked_meta == [True]
    mine, theirs = checked.state_dict(), plain.state_dict()
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    for got, want in zip(_loss_and_grads(checked, args), _loss_and_grads(plain, args), strict=True):
        assert torch.equal(got, want)


def _train(tmp_path, name: str, **kw) -> tuple[list[float], dict[str, torch.Tensor], int, set]:
    """Three steps of the Trainer on a one-block Llama: losses, final parameters, captures, the
    names of the program's tensors that are the model's."""
    cfg = TrainConfig(
        steps=3,
        batch_size=2,
        seq_len=16,
        log_every=1,
        out=str(tmp_path / name),
        plots=False,
        device="cpu",
        synthetic=True,
        **kw,
    )
    torch.manual_seed(0)
    model = tiny_llama(1)
    with exports() as count:
        trainer = Trainer(model, Plan.from_dict(RANDOM), cfg)
    shared = _shared(trainer.compiled, model)
    losses = trainer.run().losses
    params = {n: p.detach().clone() for n, p in trainer.compiled.named_parameters()}
    return losses, params, count[0], shared


def test_the_trainer_under_a_memory_limit_captures_once_and_trains_the_same(tmp_path):
    """Before: two captures under a limit (the memory check's meta build, then compile's)."""
    limited, limited_params, captures, limited_shared = _train(
        tmp_path, "limited", memory_limit_gib=1000
    )
    assert captures == 1
    free, free_params, _, free_shared = _train(tmp_path, "free")
    assert limited == free and limited_shared == free_shared and free_shared
    assert all(torch.equal(limited_params[n], free_params[n]) for n in free_params)


def test_shared_casts_of_a_meta_capture_follow_the_programs_target(monkeypatch):
    """A program captured on the meta device and bound for the CPU casts by the CPU's autocast
    rules on a machine that has CUDA too (before: CUDA's, unlike the CPU model's capture)."""
    model = LanguageModelWithLoss(tiny_llama(1))
    program = meta_program(model, Plan(), tokens(), {}, names=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _device_type(program.graph, "cpu") == "cpu"
    assert _device_type(program.graph, None) == "cuda"


def test_compiling_a_batch_norm_model_leaves_its_statistics_alone():
    """Before: the verifier's fake propagation ran ``num_batches_tracked += 1`` on the model's
    own tensor at every propagation (the compile counted batches it never ran)."""
    model = BatchNormNet()
    unchanged = _unchanged(model)
    moec.compile(model, RANDOM, tokens())
    assert unchanged()


def _pp_worker(rank: int, world: int, out: str) -> None:
    """Three PP = 2 steps without and with a memory limit: one capture, the same losses."""
    plan = Plan.from_dict({**RANDOM, "parallel": {"pp": 2, "microbatches": 2}})
    losses = []
    for name, limit in (("free", None), ("limited", 1000.0)):
        cfg = TrainConfig(
            steps=3,
            batch_size=4,
            seq_len=16,
            log_every=1,
            out=f"{out}/{name}",
            plots=False,
            device="cpu",
            synthetic=True,
            memory_limit_gib=limit,
        )
        torch.manual_seed(0)
        with exports() as count:
            trainer = Trainer(tiny_llama(4), plan, cfg)
        assert count[0] == 1
        losses.append(trainer.run().losses)
    assert losses[0] == losses[1], losses


@pytest.mark.slow
def test_a_pipelined_trainer_under_a_memory_limit_builds_each_rank_once(tmp_path):
    """Each pipeline rank materializes the program from the model (its runtime frees the other
    ranks' stages, as it does without a limit) and trains as without the limit."""
    spawn(_pp_worker, 2, str(tmp_path))
