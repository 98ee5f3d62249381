"""A dense Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU FFN.

Plain PyTorch with nothing moec-specific: it is what a user hands to ``moec.compile``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moec.models.init import normal_init


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 512
    ffn_hidden_per_layer: tuple[int, ...] | None = None
    """Per-block FFN widths (overrides ``ffn_hidden``), e.g. wide leading dense blocks."""
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)


class Attention(nn.Module):
    attend = staticmethod(causal_attention)
    """The attention kernel (a hand-written baseline may set another on an instance)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # grouped-query attention: each k/v head serves `rep` query heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = self.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, ffn_hidden: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg.dim, ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class RotaryTables(nn.Module):
    """RoPE's cos and sin tables [max_seq_len, head_dim], non-persistent buffers. A module of
    its own, rebuilt from ``config``, so that a model built on the meta device gets them back."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        head_dim = config.dim // config.n_heads
        exponents = torch.arange(0, head_dim, 2).float() / head_dim
        inv_freq = 1.0 / config.rope_theta**exponents
        angles = torch.outer(torch.arange(config.max_seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)


class Llama(nn.Module):
    """``forward(tokens[B, S]) -> logits[B, S, vocab]``."""

    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        widths = cfg.ffn_hidden_per_layer or (cfg.ffn_hidden,) * cfg.n_layers
        if len(widths) != cfg.n_layers:
            raise ValueError(
                f"ffn_hidden_per_layer has {len(widths)} entries for {cfg.n_layers} layers"
            )
        self.layers = nn.ModuleList(Block(cfg, width) for width in widths)
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryTables(cfg)
        self.apply(self._init_weights)

    _init_weights = staticmethod(normal_init)  # what --init-from fresh draws each module with

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope.cos[:seq], self.rope.sin[:seq]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
