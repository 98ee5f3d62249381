"""Tiny models shared by the tests."""

import pytest
import torch
import transformers as tf

from moec.models import GPT2, GPT2Config, Llama, LlamaConfig


def tiny_llama(layers: int = 3) -> Llama:
    return Llama(LlamaConfig(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=64))


def tiny_gpt2(layers: int = 3) -> GPT2:
    return GPT2(GPT2Config(dim=32, n_layers=layers, n_heads=4, ffn_hidden=64))


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
}
"""transformers decoder families (their class-name prefix) built by :func:`hf_family`."""


def hf_family(name: str) -> torch.nn.Module:
    """A tiny ``name`` causal LM: hidden 64, FFN 128, 2 layers, 4 heads of 16, vocab 256."""
    prefix = HF_FAMILIES[name]
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
        if hasattr(config, field):  # grouped-query families; explicit head widths
            setattr(config, field, value)
    return getattr(tf, f"{prefix}ForCausalLM")(config)


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
