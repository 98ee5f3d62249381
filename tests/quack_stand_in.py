"""A torch stand-in for the quack calls :mod:`moec.kernels.cute_gemm` makes: quack's math and
the operand layouts it requires, checked; records which calls read rows through ``A_idx`` and
which read or wrote a ``[gate | up]`` dim as pairs (``concat_layout``)."""

from __future__ import annotations

import torch


def _mm_varlen(a, b, cu_m=None, cu_k=None, a_idx=None, out=None):
    """quack's ``gemm`` semantics (as its ``gemm_ref``), checking the layouts it requires."""
    if cu_m is not None:
        assert a.stride(-1) == 1, "varlen-M takes A k-major"
        rows = a[a_idx.long()] if a_idx is not None else a
        out = rows.new_zeros(rows.shape[0], b.shape[-1]) if out is None else out
        bounds = cu_m.tolist()
        for e in range(len(bounds) - 1):
            out[bounds[e] : bounds[e + 1]] = rows[bounds[e] : bounds[e + 1]] @ b[e].to(a.dtype)
        return out
    assert a.stride(-2) == 1, "varlen-K takes A m-major"
    cols = a[:, a_idx.long()] if a_idx is not None else a
    bounds = cu_k.tolist()
    for e in range(len(bounds) - 1):
        out[e] = cols[:, bounds[e] : bounds[e + 1]] @ b[bounds[e] : bounds[e + 1]]
    return out


def _quack_act(h, name):
    unary = {"silu": torch.nn.functional.silu, "relu": torch.relu, "swiglu": None}
    if name == "swiglu":  # gated: columns (2j, 2j + 1) are (gate, up)
        return torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
    return unary[name](h)


def pairs(t, dim):
    """``[gate | up]`` along ``dim`` -> interleaved ``(gate_j, up_j)`` pairs."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1 if dim >= 0 else dim).flatten(dim - 1, dim)


def _concat_dim_strided(t, dim):
    """quack's ``concat_layout`` takes a tensor whose concat dim is not its contiguous one."""
    assert t.stride(dim) != 1, "concat_layout: the [gate | up] dim must be the strided one"


class FakeQuack:
    """The three quack calls :mod:`moec.kernels.cute_gemm` makes, in torch; records A_idx and
    each ``concat_layout`` (its [gate | up] dim read or written as interleaved pairs)."""

    def __init__(self):
        self.gathered = []
        self.concat = []

    def gemm(self, a, b, out=None, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None, tuned=True,
             concat_layout=None):  # fmt: skip
        if A_idx is not None:
            assert A_idx.dtype == torch.int32
            self.gathered.append("m" if cu_seqlens_m is not None else "k")
        if concat_layout == ("B",):  # pairs along B's contraction dim (a's columns are pairs)
            self.concat.append("B^T")
            _concat_dim_strided(b, -2)
            b = pairs(b, -2)
        if concat_layout == ("out",):  # a's rows x pairs -> out's strided [gate | up] dim
            self.concat.append("out")
            _concat_dim_strided(out, -1)
            paired = _mm_varlen(a, b, cu_seqlens_m, cu_seqlens_k, A_idx, torch.empty(out.shape))
            out.copy_(torch.cat((paired[..., 0::2], paired[..., 1::2]), dim=-1))
            return out
        return _mm_varlen(a, b, cu_seqlens_m, cu_seqlens_k, A_idx, out)

    def gemm_act(self, a, b, activation, cu_seqlens_m, A_idx=None, store_preact=True, tuned=True,
                 concat_layout=None):  # fmt: skip
        if concat_layout == ("B",):  # B's strided [gate | up] columns computed as pairs
            self.concat.append("B")
            _concat_dim_strided(b, -1)
            b = pairs(b, -1)
        h = self.gemm(a, b, cu_seqlens_m=cu_seqlens_m, A_idx=A_idx)
        return h, _quack_act(h, activation)

    def gemm_dact(self, d_y, w_t, h, activation, cu_seqlens_m, tuned=True, A_idx=None,
                  colvec_scale=None, colvec_reduce=False):  # fmt: skip
        if A_idx is not None:
            assert A_idx.dtype == torch.int32
            self.gathered.append("dact")
        d_a = _mm_varlen(d_y, w_t, cu_seqlens_m, a_idx=A_idx)
        a, vjp = torch.func.vjp(lambda t: _quack_act(t, activation), h)
        if colvec_scale is None:
            return vjp(d_a)[0], a
        assert colvec_scale.dtype == torch.float32 and colvec_scale.shape == (d_a.shape[0],)
        scale = colvec_scale[:, None]
        d_h = vjp((d_a.float() * scale).to(d_a.dtype))[0]
        scaled = ((a.float() * scale).to(a.dtype),)
        reduced = ((a.float() * d_a.float()).sum(-1),) if colvec_reduce else ()
        return d_h, *scaled, *reduced


def run_on_stand_in(monkeypatch, glu_epilogue_backend: str = "cute_glu") -> FakeQuack:
    """Route every expert GEMM of :mod:`moec.kernels` to the CuTe DSL, quack stood in for by a
    :class:`FakeQuack` (returned): the policy picks ``glu_epilogue_backend`` where a gated
    activation could run in the epilogue, ``"cute"`` everywhere else."""
    from moec.kernels import cute_gemm, grouped_gemm
    from moec.kernels import experts as kernel_experts

    def policy(piece, x, w, policy=None, glu_epilogue=False):
        return glu_epilogue_backend if glu_epilogue else "cute"

    quack = FakeQuack()
    monkeypatch.setattr(cute_gemm, "_quack", lambda: quack)
    monkeypatch.setattr(grouped_gemm, "backend", policy)
    monkeypatch.setattr(kernel_experts, "backend", policy)
    return quack
