"""Sharded training on several GPUs: upcycling a model no single GPU can train, DDP vs FSDP.

Run under torchrun, one process per GPU::

    torchrun --nproc-per-node 2 benchmarks/scale.py upcycle [--experts 16] [--steps 4]
    torchrun --nproc-per-node 2 benchmarks/scale.py ddp-vs-fsdp [--steps 6]

``upcycle``: a Llama-3.2-1B-shaped Hugging Face model (d 2048, FFN 8192, 16 layers, vocab
128256) written as a dense bf16 ``save_pretrained`` checkpoint, upcycled to ``--experts``
experts top-2 (bf16 autocast over float32 master weights, AdamW): its training state (float32
parameters and moments, bf16 gradients and working copies) exceeds one GPU. First the
single-GPU plan is compiled on the meta device and refused by the Trainer's memory check (its
message printed); then every rank builds a meta model and materializes only its part
(``--init-from``: EP = world over the experts, FSDP2 over the dense parameters) and trains.
Printed per GPU: tokens/s, useful MFU, peak memory against the per-rank prediction, host syncs
of one step.

``ddp-vs-fsdp``: the report's matched eight-layer comparison (its example scripts'
``moe_8l_ddp`` vs ``moe_8l_fsdp``), the e2e model of ``benchmarks/e2e.py`` (8 blocks, 32
experts top-8, d 1536, sequence 8192, capacity 1.25) trained with EP = world twice in one run,
one plan field apart: ``parallel.dp_shard = 1`` (dense parameters replicated, gradients
all-reduced) and ``= world`` (FSDP2). Same batches, same measurement window.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.e2e import FULL, LR, SMALL, dense_model, measure, moe_plan
from moec.analysis.rank_memory import GIB, rank_memory
from moec.plan import Plan
from moec.runtime.distributed import join_process_group
from moec.train import MemoryPlanError, TrainConfig, Trainer

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
TINY_LLAMA = dict(
    LLAMA_1B,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""``--small``: shapes for a CPU smoke run (gloo), where nothing is refused or fast."""


def _say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def _upcycle_plan(experts: int, parallel: dict, recompute: str) -> Plan:
    moe = {"num_experts": experts, "top_k": 2, "init": "upcycle", "capacity_factor": 1.25}
    return Plan.from_dict(
        {
            "moe": moe,
            "parallel": parallel,
            "precision": {"compute_dtype": "bf16"},
            "recompute": {"policy": recompute},
        }
    )


def _write_dense_checkpoint(path: Path, shape: dict, device: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(device):
        dense = LlamaForCausalLM(LlamaConfig(**shape, use_cache=False))
    dense.to(torch.bfloat16).save_pretrained(path)


def _meta_model(path: Path) -> torch.nn.Module:
    from transformers import AutoConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(AutoConfig.from_pretrained(path))


def _config(args: argparse.Namespace, steps: int, **extra) -> TrainConfig:
    return TrainConfig(
        lr=LR,
        steps=steps,
        batch_size=args.batch,
        seq_len=args.seq,
        device=args.device,
        synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_scale_"),
        plots=False,
        **extra,
    )


def _report(name: str, trainer: Trainer, args: argparse.Namespace) -> dict:
    """Measure ``trainer``'s steps; print and return this rank's numbers and the prediction."""
    tokens = args.batch * args.seq
    flops = trainer.train_flops_per_token * tokens
    device = torch.device(args.device)
    result = measure(name, trainer.train_step, device, args.steps, args.warmup, flops, tokens)
    micro = trainer.plan.parallel.microbatches
    predicted = rank_memory(trainer.compiled.program, micro, args.batch // micro, args.seq)
    result["predicted_gb"] = predicted.total / GIB
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, result["peak_mem_gb"])
    result["peak_mem_gb_per_rank"] = peaks
    mfu = "-" if result["useful_mfu"] is None else f"{100 * result['useful_mfu']:.1f}%"
    peak = "-" if None in peaks else f"{max(peaks):.1f}"
    _say(
        f"{name:20} {result['step_s']:7.3f} s/step {result['tokens_per_s']:9.0f} tok/s/GPU "
        f"MFU {mfu:>6}  peak {peak:>6} GiB (predicted {result['predicted_gb']:6.1f})  "
        f"syncs/step {result['host_syncs_per_step']}"
    )
    return result


def upcycle(args: argparse.Namespace) -> dict:
    world = dist.get_world_size()
    checkpoint = Path(args.checkpoint)
    if dist.get_rank() == 0:
        _write_dense_checkpoint(checkpoint, TINY_LLAMA if args.small else LLAMA_1B, args.device)
        single = _upcycle_plan(args.experts, {}, args.recompute)
        try:
            Trainer(_meta_model(checkpoint), single, _config(args, 1, init_from=str(checkpoint)))
            refused = None
        except MemoryPlanError as exc:
            refused = str(exc)
        print(f"single-GPU plan: {'refused' if refused else 'NOT refused'}", flush=True)
        if refused:
            print("  " + "\n  ".join(refused.splitlines()), flush=True)
    dist.barrier()
    parallel = {"dp": world, "ep": world, "dp_shard": world}
    plan = _upcycle_plan(args.experts, parallel, args.recompute)
    cfg = _config(args, args.steps + args.warmup + 1, init_from=str(checkpoint))
    trainer = Trainer(_meta_model(checkpoint), plan, cfg)
    program = trainer.compiled.program
    params = sum(  # the whole model: a DTensor's numel is the global one; experts are 1/world
        p.numel() * (world if program.role(n) == "expert" else 1)
        for n, p in trainer.compiled.named_parameters()
    )
    _say(
        f"\nupcycled {'tiny Llama' if args.small else 'Llama-3.2-1B shape'}, {args.experts} "
        f"experts top-2: {params / 1e9:.2f}B parameters ({trainer.params / 1e9:.2f}B on each "
        f"rank's program); EP {world} + FSDP {world}; {args.batch} x {args.seq} tokens per "
        f"rank; {_device_name(args.device)}"
    )
    result = _report(f"ep{world}+fsdp{world}", trainer, args)
    return {"params": params, "single_gpu_refused": dist.get_rank() != 0 or refused, **result}


def ddp_vs_fsdp(args: argparse.Namespace) -> dict:
    world = dist.get_world_size()
    s = dict(SMALL if args.small else FULL, micro=args.batch, seq=args.seq)
    results = {}
    _say(
        f"\n{s['layers']}-layer model of benchmarks/e2e.py, EP {world}, {args.batch} x "
        f"{args.seq} tokens per rank, {_device_name(args.device)}"
    )
    for name, shard in (("ddp", 1), ("fsdp", world)):
        torch.manual_seed(0)
        plan = moe_plan(s, {"dp": world, "ep": world, "dp_shard": shard})
        trainer = Trainer(dense_model(s), plan, _config(args, args.steps + args.warmup + 1))
        results[name] = _report(f"ep{world}+{name}", trainer, args)
        del trainer
        if args.device == "cuda":
            torch.cuda.empty_cache()
    _say(f"fsdp / ddp step time: {results['fsdp']['step_s'] / results['ddp']['step_s']:.3f}")
    return results


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("upcycle", "ddp-vs-fsdp"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, help="sequences per GPU per step")
    parser.add_argument("--seq", type=int, help="sequence length")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--recompute", default="none", help="recompute.policy")
    parser.add_argument("--checkpoint", help="dense checkpoint directory (default: a new one)")
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes (smoke run)")
    parser.add_argument("--json", help="write rank 0's numbers here")
    args = parser.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SMALL if args.small else FULL
    if args.mode == "upcycle":
        args.batch = args.batch or 2
        args.seq = args.seq or (64 if args.small else 4096)
    else:
        args.batch, args.seq = args.batch or shape["micro"], args.seq or shape["seq"]
    join_process_group()
    if args.mode == "upcycle" and args.checkpoint is None:  # rank 0's new folder, for all
        where = [tempfile.mkdtemp(prefix="moec_dense_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where)
        args.checkpoint = where[0]
    result = upcycle(args) if args.mode == "upcycle" else ddp_vs_fsdp(args)
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "args": vars(args), "results": result}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
