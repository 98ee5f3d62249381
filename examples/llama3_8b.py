"""Llama-3-8B's architecture, for the cost and memory model: ``moec plan show PLAN --model
examples/llama3_8b.py:llama3_8b --world 64``.

The factory builds transformers' ``LlamaForCausalLM`` from Llama-3-8B's configuration (hidden
4096, FFN 14336, 32 layers, 32 query and 8 key/value heads, vocabulary 128256, untied
embeddings, RoPE theta 500000). ``moec plan show`` and ``moec inspect`` call it on the meta
device, so no weights are allocated; called elsewhere it allocates 8B random float32 parameters
(32 GB).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    use_cache=False,
)


def llama3_8b() -> tuple[LlamaForCausalLM, tuple[torch.Tensor]]:
    """The model and an example batch of token ids (2 x 128; memory is evaluated at the
    batch and sequence length ``moec plan show`` is given)."""
    model = LlamaForCausalLM(LLAMA3_8B)
    return model, (torch.randint(0, LLAMA3_8B.vocab_size, (2, 128)),)
