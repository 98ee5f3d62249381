"""Fresh initialization of a model built on the meta device (``FreshInit``): the program's
tensors are a function of the seed alone (the same from every read order and at every layout),
have the model's own initializer's statistics, and ``moec train --init-from fresh`` trains."""

from __future__ import annotations

import copy
import json
import math
import sys
import threading

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import moec
from moec.program import fresh_seed
from moec.runtime import distributed as mdist
from moec.runtime.materialize import FreshInit, MaterializeError, materialize
from tests.distributed import spawn
from tests.models import hf_model, tokens

N, K, SEED = 4, 2, 3
INITS = ("upcycle", "random")  # random: experts drawn with the fresh dense FFN's std
NORMS = ("layernorm.weight", "norm.weight")


def _plan(init: str, ep: int = 1, world: int = 1, dp_shard: int = 1) -> dict:
    moe = {"num_experts": N, "top_k": K, "init": init, "seed": 7}
    return {"moe": moe, "parallel": {"dp": world, "ep": ep, "dp_shard": dp_shard}}


def _meta() -> nn.Module:
    with torch.device("meta"):
        return hf_model("llama")


def _compile_fresh(plan: dict, seed: int, mesh=None) -> moec.CompiledModel:
    return moec.compile(_meta(), plan, (tokens(),), mesh=mesh, init_from=FreshInit(seed=seed))


def _tensors(compiled: moec.CompiledModel) -> dict[str, torch.Tensor]:
    gm = compiled.graph_module
    named = [*gm.named_parameters(), *gm.named_buffers()]
    return {name: t.detach().clone() for name, t in named}


def _fresh(plan: dict, seed: int, mesh=None) -> dict[str, torch.Tensor]:
    return _tensors(_compile_fresh(plan, seed, mesh))


@pytest.mark.parametrize(
    "init", [pytest.param(i, marks=pytest.mark.slow) if i == "upcycle" else i for i in INITS]
)
def test_fresh_tensors_depend_on_the_seed_alone_with_the_models_init_statistics(init):
    compiled = _compile_fresh(_plan(init), SEED)
    first, again, other = (
        _tensors(compiled),  # copies: the forward below reads the compiled model's own tensors
        _fresh(_plan(init), SEED),
        _fresh(_plan(init), SEED + 1),
    )
    assert first.keys() == again.keys() == other.keys()
    for name, value in first.items():
        assert value.device.type == "cpu" and bool(value.isfinite().all()), name
        assert torch.equal(value, again[name]), name
        if name.endswith(NORMS):  # transformers' _init_weights: RMSNorm weights are ones
            assert bool((value == 1).all()), name
        elif name.endswith(("weight", "w_up", "w_down")) and "router" not in name:
            # (the router is drawn from the plan's moe.seed, not from the dense model)
            assert not torch.equal(value, other[name]), name
            # initializer_range 0.02 (linear, embedding; experts repeat or redraw at that std)
            assert abs(float(value.std()) - 0.02) < 0.003, (name, float(value.std()))
            assert abs(float(value.mean())) < 0.004, name
    assert bool(compiled(tokens()).logits.isfinite().all())


def test_fresh_values_do_not_depend_on_the_read_order():
    model = _meta()
    names = [n for n, _ in model.named_parameters()]
    forward = FreshInit(SEED, model)
    backward = FreshInit(SEED, model)
    want = {n: forward.read(n, None, None) for n in names}
    got = {n: backward.read(n, None, None) for n in reversed(names)}
    for name in names:
        assert torch.equal(got[name], want[name]), name
    rows = backward.read(names[1], slice(2, 5), None)  # a part is the whole's rows
    assert torch.equal(rows, want[names[1]][2:5])
    for order in (names, names[::-1]):  # drawn ahead as foreseen, or against the reads
        ahead = FreshInit(SEED, model)
        ahead.prefetch(order)
        got = {n: ahead.read(n, None, None) for n in names}
        ahead.close()
        assert all(torch.equal(got[n], want[n]) for n in names)


class _DrawsUnseeded(nn.Module):
    """Its initializer calls ``torch.randn(size)``, an op that takes no generator."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(5, 3))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.copy_(torch.randn(5, 3))


class _Rates(nn.Module):
    """Its initializer draws Poisson counts and Gamma samples (ops whose generator is not
    keyword-only)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts, self.gamma = nn.Parameter(torch.empty(7)), nn.Parameter(torch.empty(7))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.counts.copy_(torch.poisson(torch.full((7,), 3.0)))
            self.gamma.copy_(torch.distributions.Gamma(2.0, 1.0).sample((7,)))


class _Mixed(nn.Module):
    """Modules drawn by their own ``reset_parameters()`` (kaiming-uniform, normal, ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.conv = nn.Embedding(11, 6), nn.Conv1d(6, 6, 3)
        self.proj, self.norm, self.drawn = nn.Linear(6, 4), nn.LayerNorm(4), _DrawsUnseeded()
        self.rates = _Rates()


class _Custom(_Mixed):
    """A model initializer of its own (truncated normal, orthogonal, xavier, in-place uniform);
    the modules it leaves NaN fall back to their ``reset_parameters()``."""

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Conv1d):
            nn.init.orthogonal_(module.weight)
            module.bias.data.uniform_(-1, 1)
        elif isinstance(module, nn.Embedding):
            nn.init.xavier_normal_(module.weight)


def _global_generator_reference(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Module ``path``'s parameters as its initializer draws them on the CPU after
    ``torch.manual_seed(fresh_seed(SEED, path))`` (the model's ``_init_weights`` where it
    fills them all, else the module's ``reset_parameters()``)."""
    module = model.get_submodule(path)
    reset = getattr(type(module), "reset_parameters", None)
    for initialize in (getattr(model, "_init_weights", None), reset):
        clone = copy.deepcopy(module).to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for p in clone.parameters(recurse=False):
                p.fill_(math.nan)
        torch.manual_seed(fresh_seed(SEED, path))
        if initialize is not None:
            with torch.no_grad():
                initialize(clone)
        own = {n: p.detach() for n, p in clone.named_parameters(recurse=False)}
        if not any(bool(p.isnan().any()) for p in own.values()):
            return own
    raise AssertionError(f"no initializer fills {path}")


def _built(kind: str) -> nn.Module:
    with torch.device("meta"):
        return (
            hf_model("llama")
            if kind == "hf-llama"
            else {"mixed": _Mixed, "custom": _Custom}[kind]()
        )


@pytest.mark.parametrize("kind", ["hf-llama", "mixed", "custom"])
def test_fresh_values_are_the_global_generators_after_manual_seed(kind):
    """Each module is drawn from a generator of its own, several at once, to the values
    ``torch.manual_seed`` of its seed gives (``_DrawsUnseeded`` calls an op that takes no
    generator: it is drawn from the global one, to the same values), while another thread
    reseeds and draws from the global generator throughout: no draw moves another."""
    model = _built(kind)
    names = [n for n, _ in model.named_parameters()]
    stop = threading.Event()

    def reseed_and_draw() -> None:
        while not stop.is_set():
            torch.manual_seed(0)
            torch.randn(64)

    other = threading.Thread(target=reseed_and_draw)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave between any two draws
    other.start()
    try:
        source = FreshInit(SEED, model)
        source.prefetch(names)
        got = {n: source.read(n, None, None) for n in names}
        source.close()
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(switch)
    for name in names:
        path, _, attr = name.rpartition(".")
        want = _global_generator_reference(model, path)[attr]
        assert torch.equal(got[name], want), name


def test_materialize_leaves_the_callers_random_state_as_it_was():
    program = moec.compile(_meta(), _plan("random"), (tokens(),)).program
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    materialize(program, FreshInit(SEED), "cpu", _meta())
    assert torch.equal(torch.random.get_rng_state(), state)


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class _HalfGain(_Gain):
    def reset_parameters(self) -> None:  # fills half the parameter: not an initializer of it
        with torch.no_grad():
            self.gain[:4] = 1.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = _Gain()
        self.partial = _HalfGain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.proj(x))


def test_parameter_no_initializer_fills_and_unbound_source_are_named():
    with torch.device("meta"):
        net = _Net()
    source = FreshInit(SEED, net)
    assert source.read("proj.weight", None, None).shape == (8, 8)  # Linear.reset_parameters
    with pytest.raises(MaterializeError, match=r"parameter scale\.gain.*_Gain.*tried: none"):
        source.read("scale.gain", None, None)
    with pytest.raises(MaterializeError, match=r"partial\.gain.*tried: _reset_parameters"):
        source.read("partial.gain", None, None)
    program = moec.compile(hf_model("llama"), _plan("upcycle"), (tokens(),)).program
    with pytest.raises(MaterializeError, match=r"FreshInit\(seed=3\) has no model"):
        materialize(program, FreshInit(SEED))


LAYOUTS = (("upcycle", 1), ("random", 2))
"""(init, dp_shard) run on 2 ranks with EP = 2: expert slices alone, then FSDP shards too."""


def _layout_worker(rank: int, world: int, reference: str) -> None:
    """This rank's experts are its rows of the one-process program's; its dense tensors
    (gathered where FSDP shards them) equal the one-process program's."""
    references = torch.load(reference)
    local = N // world
    experts = slice(rank * local, (rank + 1) * local)
    for init, dp_shard in LAYOUTS:
        plan = moec.Plan.from_dict(_plan(init, ep=world, world=world, dp_shard=dp_shard))
        model = moec.compile(
            _meta(), plan, (tokens(),), mesh=mdist.build_mesh(plan), init_from=FreshInit(SEED)
        )
        full, sharded = references[init], 0
        gm = model.graph_module
        for name, value in [*gm.named_parameters(), *gm.named_buffers()]:
            if isinstance(value, DTensor):  # every rank gathers, in the same order
                value, sharded = value.full_tensor(), sharded + 1
            want = full[name][experts] if model.program.role(name) == "expert" else full[name]
            assert torch.equal(value.detach(), want), (init, dp_shard, name)
        assert (sharded > 0) == (dp_shard > 1)


@pytest.mark.slow  # two spawned ranks: ~25 s
def test_every_layout_builds_the_one_process_tensors(tmp_path):
    references = {init: _fresh(_plan(init), SEED) for init in INITS}
    torch.save(references, tmp_path / "reference.pt")
    spawn(_layout_worker, 2, str(tmp_path / "reference.pt"))


def _train_fresh(tmp_path, model: str) -> dict:
    """``moec train --model MODEL --init-from fresh`` for 2 steps on the CPU: its summary."""
    import yaml

    from moec.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"moe": {"num_experts": N, "top_k": K}}))
    out = tmp_path / "run"
    argv = ["train", "--model", model, "--plan", str(plan), "--init-from", "fresh"]
    argv += ["--synthetic", "--steps", "2", "--batch-size", "4", "--seq-len", "16"]
    argv += ["--log-every", "1", "--device", "cpu", "--seed", "5", "--out", str(out)]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())


NO_INITIALIZER_NOTE = "has no _init_weights(module)"


@pytest.mark.parametrize("model", ["hf-llama", "llama", "gpt2"])  # transformers', moec's own
def test_moec_train_init_from_fresh_trains_a_meta_built_model(tmp_path, capsys, model):
    summary = _train_fresh(tmp_path, model)
    captured = capsys.readouterr()
    assert NO_INITIALIZER_NOTE not in captured.out + captured.err
    assert summary["steps"] == 2
    # logits of a 0.02-std initialization are near zero: the loss starts near log(vocab)
    assert abs(summary["first_loss"] - math.log(256)) < 0.1, summary["first_loss"]
    assert math.isfinite(summary["final_loss"])


def test_init_from_fresh_says_when_the_model_has_no_initializer(tmp_path, capsys):
    """Without ``_init_weights(module)`` each module draws its ``reset_parameters()``: what the
    model's own ``__init__`` applied after that is lost, and the run says so."""
    factory = tmp_path / "no_initializer.py"
    factory.write_text(
        "import torch\n"
        "from moec.models.llama import Llama, LlamaConfig\n\n\n"
        "def no_initializer():\n"
        "    model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2))\n"
        "    model._init_weights = None  # as a model that initializes in its __init__ alone\n"
        "    return model, (torch.randint(0, 256, (2, 16)),)\n"
    )
    summary = _train_fresh(tmp_path, f"{factory}:no_initializer")
    captured = capsys.readouterr()
    assert f"Llama {NO_INITIALIZER_NOTE}" in captured.out + captured.err
    assert math.isfinite(summary["final_loss"])
