"""Materialization from a dense checkpoint: a model built on the meta device, compiled with
``init_from``, equals the model compiled from the real weights (every init, EP slices included),
reads only its rank's part, and names what is missing or mismatched."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moec
from moec.models.llama import Llama, LlamaConfig
from moec.program import (
    ExpertSlice,
    Fresh,
    FromSource,
    MeanOf,
    Repeated,
    Scaled,
    Stacked,
    StdOf,
    TensorBuilder,
)
from moec.runtime import distributed as mdist
from moec.runtime.materialize import MaterializeError, open_source
from tests.distributed import spawn
from tests.models import hf_model, tiny_llama, tokens

N, K = 4, 2
FFN = ("gate_proj", "up_proj", "down_proj")
FFN_WEIGHTS = tuple(f"{p}.weight" for p in FFN)


VARIANTS = {
    "granular": {"init": "upcycle", "upcycle_granularity": 2},
    "granular_drop": {"init": "drop_upcycle", "upcycle_granularity": 2, "drop_upcycle_ratio": 0.25},
}
"""Upcycling variants by test name: their ``moe`` fields (other names are ``moe.init``)."""


def _plan(init: str, shared: bool = False, ep: int = 1, world: int = 1, dtype="fp32") -> dict:
    moe = {"num_experts": N, "top_k": K, "shared_expert": shared, "seed": 7}
    moe |= VARIANTS.get(init, {"init": init})
    parallel = {"dp": world, "ep": ep}
    return {"moe": moe, "parallel": parallel, "precision": {"compute_dtype": dtype}}


def _dense_and_checkpoint(path: Path | None, max_shard_size: str | None = None) -> torch.nn.Module:
    """A dense HF Llama, saved to ``path`` (None: not saved)."""
    dense = hf_model("llama")
    with torch.no_grad():  # no weights that happen to be equal (norms start at one)
        for p in dense.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    if path is not None:
        dense.save_pretrained(path, **kwargs)
    return dense


def _meta() -> torch.nn.Module:
    with torch.device("meta"):
        return hf_model("llama")


def _tensors(model) -> dict[str, torch.Tensor]:
    gm = model.graph_module
    return {**dict(gm.named_parameters()), **dict(gm.named_buffers())}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].device.type == "cpu", name
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        assert got[name].stride() == value.stride(), name  # k-major expert weights stay so


@pytest.mark.parametrize(
    "init,shared,dtype",
    [
        ("upcycle", False, "fp32"),
        pytest.param("upcycle", True, "bf16", marks=pytest.mark.slow),  # + working copies
        ("split", False, "fp32"),
        ("random", False, "fp32"),
        ("granular", False, "fp32"),
        ("drop_upcycle", False, "fp32"),
        pytest.param("granular_drop", True, "fp32", marks=pytest.mark.slow),
    ],
)
def test_meta_model_from_safetensors_equals_compiling_the_real_model(tmp_path, init, shared, dtype):
    dense = _dense_and_checkpoint(tmp_path)
    x = tokens()
    plan = _plan(init, shared, dtype=dtype)
    want = moec.compile(copy.deepcopy(dense), plan, (x,))
    got = moec.compile(_meta(), plan, (x,), init_from=tmp_path)
    assert bool(got.program.working_weights) == (dtype == "bf16")
    _assert_same(_tensors(got), _tensors(want))
    provenance = got.program.provenance
    w_up = provenance["model.layers.0.mlp.moe.w_up"]
    assert isinstance(w_up, Repeated if init == "upcycle" else Stacked)
    down = provenance.get("model.layers.0.mlp.down_proj.weight")
    assert isinstance(down, Scaled) if shared else down is None
    torch.testing.assert_close(got(x).logits, want(x).logits, rtol=0, atol=0)


def test_granular_drop_upcycling_from_a_state_dict_equals_compiling_the_real_model():
    """Granular drop-upcycled provenance (slices, virtual-group router, redrawn units with the
    dense statistics) built from a state dict equals building it from the real model."""
    dense = _dense_and_checkpoint(None)
    x = tokens()
    want = moec.compile(copy.deepcopy(dense), _plan("granular_drop"), (x,))
    got = moec.compile(_meta(), _plan("granular_drop"), (x,), init_from=dense.state_dict())
    _assert_same(_tensors(got), _tensors(want))


def test_upcycled_first_loss_equals_dense_loss_from_sharded_checkpoint(tmp_path):
    dense = _dense_and_checkpoint(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    x = tokens()
    targets = torch.randint(0, 256, x.shape)
    plan = _plan("upcycle")
    plan["moe"]["capacity_factor"] = None  # dropless: every token reaches its experts
    model = moec.compile(_meta(), plan, (x,), init_from=tmp_path)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    torch.testing.assert_close(
        loss(model(x).logits), loss(dense(x).logits.float()), rtol=1e-5, atol=1e-5
    )


def _ep_worker(rank: int, world: int, path: str, reference: str) -> None:
    """EP = world from the checkpoint: this rank's experts are its rows of the EP = 1 program's
    (``reference``: name -> tensor per init), read from only its part of the dense FFNs."""
    references = torch.load(reference)
    local = N // world
    experts = slice(rank * local, (rank + 1) * local)
    for init in INITS:
        plan = moec.Plan.from_dict(_plan(init, ep=world, world=world))
        source = open_source(path)
        model = moec.compile(
            _meta(), plan, (tokens(),), mesh=mdist.build_mesh(plan), init_from=source
        )
        full = references[init]
        for name, value in _tensors(model).items():
            is_expert = model.program.role(name) == "expert"
            assert torch.equal(value, full[name][experts] if is_expert else full[name]), name
            if is_expert:
                source_of = model.program.provenance[name]
                assert isinstance(source_of, ExpertSlice)
                assert (source_of.start, source_of.stop) == (experts.start, experts.stop)
        ffn_reads = [r for r in source.reads if r.name.endswith(FFN_WEIGHTS)]
        if init in ("upcycle", "drop_upcycle"):  # each dense FFN tensor read once, whole
            # (drop_upcycle: its redrawn units' statistics are the whole matrix's)
            assert len(ffn_reads) == len({r.name for r in ffn_reads}) == 2 * len(FFN)
            assert all(r.rows is None and r.cols is None for r in ffn_reads)
        elif init == "split":  # this rank's hidden units only: rows of gate/up, columns of down
            width = 64 // N
            mine = (rank * local * width, (rank + 1) * local * width)
            for read in ffn_reads:
                cut = read.cols if read.name.endswith("down_proj.weight") else read.rows
                assert mine[0] <= cut.start < cut.stop <= mine[1], (read, mine)
            rows = sum(r.shape[0] for r in ffn_reads if "down" not in r.name)
            assert rows == 2 * 2 * local * width  # gate + up, two layers


INITS = ("upcycle", "split", "random", "granular", "drop_upcycle", "granular_drop")
"""random and drop_upcycle: each expert's draws seeded alone, the same values on every rank."""


@pytest.mark.slow
def test_ep2_ranks_materialize_and_read_only_their_experts(tmp_path):
    _dense_and_checkpoint(tmp_path)
    x = tokens()
    references = {
        init: {
            name: t.detach().clone()
            for name, t in _tensors(
                moec.compile(_meta(), _plan(init), (x,), init_from=tmp_path)
            ).items()
        }
        for init in INITS
    }
    torch.save(references, tmp_path / "reference.pt")
    spawn(_ep_worker, 2, str(tmp_path), str(tmp_path / "reference.pt"))


@pytest.mark.slow
def test_missing_tensor_and_shape_mismatch_are_named(tmp_path):
    dense = _dense_and_checkpoint(tmp_path)
    state = dense.state_dict()
    x = tokens()
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(MaterializeError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        moec.compile(_meta(), _plan("upcycle"), (x,), init_from=missing)
    wrong = {**state, "model.norm.weight": torch.ones(48)}
    with pytest.raises(MaterializeError, match=r"model\.norm\.weight.*\(48,\).*\(32,\)"):
        moec.compile(_meta(), _plan("upcycle"), (x,), init_from=wrong)
    with pytest.raises(MaterializeError, match="cannot read a checkpoint"):
        moec.compile(_meta(), _plan("upcycle"), (x,), init_from=tmp_path / "absent")


def test_a_meta_llama_gets_its_rope_tables_back_from_their_config():
    """moec's Llama keeps its RoPE tables in a parameter-free module with a config: on the meta
    device they are rebuilt from it, so a checkpoint without them (they are not persistent)
    materializes the model it was saved from."""
    torch.manual_seed(0)
    real = tiny_llama(layers=1)
    with torch.device("meta"):
        meta = tiny_llama(layers=1)
    x = tokens(seq=8)
    model = moec.compile(meta, _plan("upcycle"), (x,), init_from=real.state_dict())
    assert torch.equal(model.graph_module.get_buffer("rope.cos"), real.rope.cos)
    reference = moec.compile(real, _plan("upcycle"), (x,))
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


class _ScaledEmbeddingLlama(Llama):
    """Its embeddings scaled by a table its own __init__ computes: no config rebuilds it and no
    initializer fills it."""

    def __init__(self) -> None:
        super().__init__(LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64))
        self.register_buffer("embed_scale", torch.linspace(0.5, 1.5, 32), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.embed(tokens) * self.embed_scale
        for layer in self.layers:
            x = layer(x, self.rope.cos[:seq], self.rope.sin[:seq])
        return self.lm_head(self.norm(x))


def test_buffer_neither_in_checkpoint_nor_recomputable_is_named():
    """A buffer computed in a module's own __init__ (no config to rebuild a small module from,
    no initializer) can come only from the checkpoint on the meta device."""
    real = _ScaledEmbeddingLlama()
    state = real.state_dict()
    with torch.device("meta"):
        meta = _ScaledEmbeddingLlama()
    x = tokens(seq=8)
    with pytest.raises(MaterializeError, match=r"buffer embed_scale is neither in the state dict"):
        moec.compile(meta, _plan("upcycle"), (x,), init_from=state)
    persistent = {**state, "embed_scale": real.embed_scale}
    model = moec.compile(meta, _plan("upcycle"), (x,), init_from=persistent)
    assert torch.equal(model.graph_module.get_buffer("embed_scale"), real.embed_scale)


@pytest.mark.parametrize(
    "variant,option",
    [
        ({}, "init=upcycle,"),
        ({"upcycle_granularity": 2}, "init=upcycle(granularity=2),"),
        pytest.param(
            {"init": "drop_upcycle", "drop_upcycle_ratio": 0.25},
            "init=drop_upcycle(ratio=0.25,granularity=1),",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_moec_train_init_from_a_dense_checkpoint_starts_at_the_dense_loss(
    tmp_path, variant, option
):
    """``moec train --init-from``: the model is built on the meta device and the program read
    from the checkpoint; the first (upcycled or granular, dropless) loss is the dense model's;
    Drop-Upcycling's redrawn units move it away. The plan's fields reach the ``moe`` pass."""
    import json

    import yaml

    from moec.cli import main
    from moec.data import TextBatches
    from moec.models.zoo import load_model
    from moec.train import language_model_loss

    torch.manual_seed(0)
    dense = load_model("hf-llama")[0]
    dense.save_pretrained(tmp_path / "dense")
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        yaml.safe_dump({"moe": {"num_experts": N, "top_k": K, "capacity_factor": None, **variant}})
    )
    out = tmp_path / "run"
    argv = ["train", "--model", "hf-llama", "--plan", str(plan), "--init-from"]
    argv += [str(tmp_path / "dense"), "--synthetic", "--steps", "2", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--log-every", "1", "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    inputs, targets = TextBatches(4, 16, 0, True, dense.config.vocab_size).batch(0)
    with torch.no_grad():
        want = language_model_loss(dense(inputs), targets).item()
    summary = json.loads((out / "summary.json").read_text())
    assert option in summary["plan"], summary["plan"]
    first = summary["first_loss"]
    if variant.get("init") == "drop_upcycle":
        assert abs(first - want) > 1e-4, (first, want)  # 10x the tolerance of equal
    else:
        assert abs(first - want) < 1e-5, (first, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_experts_drawn_in_parallel_are_each_experts_own_draw(threads):
    """Random experts are drawn in parallel threads into one tensor; each expert's values are
    still ``randn(its seed) * std + mean`` exactly (statistics of the dense matrix), whatever
    the thread count, and a lone ``Fresh`` gives its expert's values."""
    dense = torch.randn(16, 24) * 0.3 + 0.1
    read = lambda name, rows, cols: dense  # noqa: E731
    std, mean = StdOf((FromSource("w"),)), MeanOf((FromSource("w"),))
    parts = tuple(Fresh("normal", (3, 5), std, seed=100 + e, mean=mean) for e in range(6))
    want = torch.stack(
        [torch.randn(3, 5, generator=torch.Generator().manual_seed(100 + e)) for e in range(6)]
    )
    want = want * float(dense.std()) + float(dense.mean())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = TensorBuilder(read, "cpu").tensor(Stacked(parts), torch.float32)
        lone = TensorBuilder(read, "cpu").tensor(parts[4], torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert torch.equal(lone, want[4])
