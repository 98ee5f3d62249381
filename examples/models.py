"""Model factories for the CLI: ``moec inspect examples/models.py:small_llama``.

A factory returns ``(model, example_inputs)``; any dense ``nn.Module`` works.
"""

import torch

from moec.models import GPT2, GPT2Config, Llama, LlamaConfig


def small_llama():
    model = Llama(LlamaConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden=1024))
    return model, (torch.randint(0, 256, (2, 128)),)


def small_gpt2():
    model = GPT2(GPT2Config(dim=256, n_layers=6, n_heads=8, ffn_hidden=1024))
    return model, (torch.randint(0, 256, (2, 128)),)
