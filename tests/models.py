"""Tiny models shared by the tests."""

from collections.abc import Callable

import pytest
import torch
import transformers as tf

from moec.models import GPT2, GPT2Config, Llama, LlamaConfig


def tiny_llama(layers: int = 3) -> Llama:
    return Llama(LlamaConfig(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=64))


def tiny_gpt2(layers: int = 3) -> GPT2:
    return GPT2(GPT2Config(dim=32, n_layers=layers, n_heads=4, ffn_hidden=64))


class HalvedProjection(torch.nn.Module):
    """One projection to [gate | up] split in halves after it (Phi-3, GLM), in the ways
    models write the split; ``up_first``: the first half is the up projection."""

    def __init__(self, split: str, up_first: bool = False):
        super().__init__()
        self.gate_up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(16, 8)
        self.split, self.up_first = split, up_first

    def forward(self, x):
        h = self.gate_up(x)
        if self.split == "chunk":
            first, second = h.chunk(2, dim=-1)
        elif self.split == "split":
            first, second = torch.split(h, [16, 16], dim=-1)
        else:
            first, second = h[..., :16], h[..., 16:]
        gate, up = (second, first) if self.up_first else (first, second)
        return x + self.down(torch.nn.functional.silu(gate) * up)


def hf_model(name: str) -> torch.nn.Module:
    common = dict(vocab_size=256, num_hidden_layers=2, num_attention_heads=4, use_cache=False)
    if name == "llama":
        return tf.LlamaForCausalLM(
            tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **common)
        )
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(
            tf.Qwen2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **common)
        )
    cfg = tf.GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return tf.GPT2LMHeadModel(cfg)


HF_FAMILIES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "olmo2": "Olmo2",
    "phi": "Phi",
    "gpt_neox": "GPTNeoX",
    "gemma": "Gemma",
    "phi3": "Phi3",
    "glm": "Glm",
}
"""transformers decoder families (their class-name prefix) built by :func:`hf_family`."""
MORE_FAMILIES = {
    "gemma2": "Gemma2",
    "gemma3": "Gemma3Text",
    "glm4": "Glm4",
    "stablelm": "StableLm",
    "granite": "Granite",
    "cohere": "Cohere",
    "starcoder2": "Starcoder2",
    "opt": "OPT",
    "olmo": "Olmo",
    "olmo3": "Olmo3",
    "gptj": "GPTJ",
    "bloom": "Bloom",
    "gpt_bigcode": "GPTBigCode",
    "falcon": "Falcon",
    "exaone4": "Exaone4",
    "smollm3": "SmolLM3",
    "ministral": "Ministral",
    "helium": "Helium",
    "arcee": "Arcee",
    "nemotron": "Nemotron",
    "persimmon": "Persimmon",
    "ernie4_5": "Ernie4_5",
    "hunyuan_v1_dense": "HunYuanDenseV1",
    "seed_oss": "SeedOss",
    "cohere2": "Cohere2",
    "doge": "Doge",
    "mpt": "Mpt",
    "diffllama": "DiffLlama",
    "lfm2": "Lfm2",
    "falcon_h1": "FalconH1",
    "jais2": "Jais2",
}
"""Further families :func:`hf_family` builds (skipped where the installed transformers lacks
one): capture breadth, in the slow set."""
UNSUPPORTED_FAMILIES = {"apertus": "Apertus", "bitnet": "BitNet", "afmoe": "Afmoe"}
"""Families moec refuses, or converts in part, with a reason: Apertus's xIELU, an activation
with learned parameters; BitNet's norm between the activation and the down projection; AFMoE's
MoE layers, which route already (its dense first layer is converted)."""
_MODEL_CLASS = {"Gemma3Text": "Gemma3ForCausalLM"}
_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
_FIELDS = {  # families whose configs name the sizes otherwise, or default to dropout
    "OPT": {"ffn_dim": 128, "word_embed_proj_dim": 64, "dropout": 0.0},
    "GPTJ": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "rotary_dim": 8},
    "GPTBigCode": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, **_NO_DROPOUT},
    "Bloom": {"n_layer": 2, "n_head": 4},
    "SeedOss": {"attention_dropout": 0.0, "residual_dropout": 0.0},
}


def hf_family(name: str) -> torch.nn.Module:
    """A tiny ``name`` causal LM: hidden 64, FFN 128, 2 layers, 4 heads of 16, vocab 256."""
    prefix = {**HF_FAMILIES, **MORE_FAMILIES, **UNSUPPORTED_FAMILIES}[name]
    if not hasattr(tf, f"{prefix}Config"):
        pytest.skip(f"transformers {tf.__version__} has no {prefix} models")
    config = getattr(tf, f"{prefix}Config")(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    for field, value in (("num_key_value_heads", 2), ("head_dim", 16)):
        derived = isinstance(getattr(type(config), field, None), property)  # Falcon's head_dim
        if hasattr(config, field) and not derived:  # grouped-query families; head widths
            setattr(config, field, value)
    for field, value in _FIELDS.get(prefix, {}).items():
        setattr(config, field, value)
    return getattr(tf, _MODEL_CLASS.get(prefix, f"{prefix}ForCausalLM"))(config)


def train_one_step(compiled: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> list[str]:
    """A backward of ``loss_of()`` with finite gradients, non-zero on every expert tensor; an SGD
    step that changes the experts; a finite loss after it. Returns the expert tensors' names."""
    loss = loss_of()
    loss.backward()
    params = dict(compiled.named_parameters())
    grads = {name: p.grad for name, p in params.items() if p.grad is not None}
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
    experts = [name for name in grads if name.endswith((".moe.w_up", ".moe.w_down"))]
    assert experts and all(bool(grads[name].abs().sum() > 0) for name in experts)
    before = {name: params[name].detach().clone() for name in experts}
    torch.optim.SGD(compiled.parameters(), lr=0.1).step()
    assert all(not torch.equal(params[name], before[name]) for name in experts)
    assert torch.isfinite(loss_of())
    return experts


def loss_and_grads(compiled, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A compiled model's loss on ``ids`` (its output's mean square plus the router losses)
    after its backward, and the gradients of its parameters by name."""
    out = compiled(ids)
    loss = out.float().square().mean() + compiled.aux_loss()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in compiled.graph_module.named_parameters()}


def assert_same_grads(got: dict, want: dict, atol: float, rtol: float) -> None:
    """The same parameters, each gradient within the tolerance."""
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=atol, rtol=rtol, msg=name)


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq))


def rewrite_reference(compile_without_pass, pass_name: str):
    """(model, tokens, (loss, gradients)) for a tiny Llama compiled by ``compile_without_pass``
    (model, ids) -> compiled: what a value-keeping rewrite ``pass_name`` is compared against."""
    torch.manual_seed(0)
    model, ids = tiny_llama(layers=2), tokens(batch=2, seq=16)
    base = compile_without_pass(model, ids)
    assert pass_name not in base.pass_results
    return model, ids, loss_and_grads(base, ids)


def assert_same_work(compiled, other) -> None:
    """The cost model counts the same training FLOPs for both programs."""
    from moec.analysis.cost import graph_cost

    flops = [graph_cost(c.program).evaluate().train_flops for c in (compiled, other)]
    assert flops[0] == pytest.approx(flops[1])


def compile_without(model, args: tuple, plan, skipped: str | None):
    """``moec.compile`` with the pass named ``skipped`` left out of the plan's pipeline."""
    import moec

    return moec.compile(model, plan, args, disable=[skipped] if skipped else [])


class EmbeddingDropoutLlama(Llama):
    """A tiny Llama whose embeddings go through dropout: its training step draws from the
    random stream, so tests of that stream (resume, evaluation between steps) see a run that
    consumes it (the random routings that once did so are benchmark baselines now)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope.cos[:seq], self.rope.sin[:seq]
        x = torch.nn.functional.dropout(self.embed(tokens), 0.1, self.training)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def tiny_dropout_llama(layers: int = 3) -> EmbeddingDropoutLlama:
    cfg = LlamaConfig(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    return EmbeddingDropoutLlama(cfg)
