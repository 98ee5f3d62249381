"""Your own training loop around a compiled model (what ``moec train`` does, in 30 lines).

    python -m examples.train_loop [--steps 50]      (from the repository root)
"""

import argparse

import torch

import moec
from examples.models import small_llama
from moec.data import TextBatches
from moec.train import language_model_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    dense, _ = small_llama()
    plan = moec.Plan.load("examples/plans/demo.yaml")
    data = TextBatches(batch_size=8, seq_len=128)
    compiled = moec.compile(dense, plan, example_inputs=(data.batch(0)[0],))
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)  # after compile: experts exist
    for step in range(args.steps):
        inputs, targets = data.batch(step)
        loss = language_model_loss(compiled(inputs), targets)
        (loss + compiled.aux_loss()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            stats = next(iter(compiled.routing_stats().values()))
            print(f"step {step} loss {loss.item():.3f} drop {stats['drop_rate']:.1%}")


if __name__ == "__main__":
    main()
