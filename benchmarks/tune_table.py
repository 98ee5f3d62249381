"""Fill moec's shipped tile table (``moec/kernels/tuning.json``) by autotuning on this GPU.

Runs ``benchmarks/e2e.py``'s moec training steps (the Table 47 workload; ``--small``: its
SMALL shape) with autotuning on, the table switched off (``MOEC_TUNING_TABLE=0``) and a fresh
moec cache, so that every autotuned Triton kernel those steps launch is benchmarked here, under
the GEMM policy with the CuTe DSL and again without it (which sends more pieces to moec's
Triton kernels). The choices moec recorded (:func:`moec.cache.tuning_record`) are then written
into the table under this GPU's product (H100, H200, B200, B300), replacing that product's
entries for the same kernels and buckets. Review the diff, and record the run (device, commit,
command) in ``benchmarks/RESULTS.md`` before committing the table.

quack's GEMMs autotune in quack's autotuner: the records it wrote into the run's quack cache
are written into the table too (kernel ``quack-<version>``, :func:`moec.kernels.tuning.seed_quack`
puts them back into a cache).

``--record FILE`` merges the choices another run recorded instead of tuning here (no GPU
needed): the ``tuning_choices.json`` in the moec cache of a run that autotuned with the table
off, or with no entries yet for its product (e.g. ``benchmarks/first_step.py``'s cold launch),
under the GEMM policy that run used. ``--quack-records DIR --product P --quack-version V``
merges the quack records of such a run's quack cache folder (``CACHE/.../quack``).

    python benchmarks/tune_table.py [--small] [--steps 2] [--table PATH] [--dry-run]
    python benchmarks/tune_table.py --record CACHE/.../tuning_choices.json [--table PATH]
    python benchmarks/tune_table.py --quack-records CACHE/.../quack --product H100 \
        --quack-version 0.6.5 [--table PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# before moec's kernels are built: every candidate benchmarked, none taken from the table
os.environ["MOEC_AUTOTUNE"] = "1"
os.environ["MOEC_TUNING_TABLE"] = "0"
os.environ["MOEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="moec_tune_table_")

import torch  # noqa: E402

from benchmarks import e2e  # noqa: E402
from moec import cache  # noqa: E402
from moec.kernels import gemm_backend, tuning  # noqa: E402
from moec.train import TrainConfig, Trainer  # noqa: E402


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="e2e's SMALL shape")
    parser.add_argument("--steps", type=int, default=2, help="training steps per policy")
    parser.add_argument("--table", default=str(tuning.TABLE), help="the table file to update")
    parser.add_argument("--dry-run", action="store_true", help="print the entries, write nothing")
    parser.add_argument("--record", help="merge this recorded tuning_choices.json, tune nothing")
    parser.add_argument("--quack-records", help="merge the records of this quack cache folder")
    parser.add_argument("--product", choices=tuning.PRODUCTS, help="the GPU of --quack-records")
    parser.add_argument("--quack-version", help="the quack version of --quack-records")
    return parser


def tune(small: bool, steps: int) -> dict[str, dict[str, dict]]:
    """Run the workload's steps under both GEMM policies; the choices recorded, by product."""
    cache.setup()
    s = e2e.SMALL if small else e2e.FULL
    cfg = TrainConfig(
        lr=e2e.LR,
        steps=2 * steps,
        batch_size=s["micro"],
        seq_len=s["seq"],
        device="cuda",
        synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_tune_table_run_"),
        plots=False,
    )
    trainer = Trainer(e2e.dense_model(s), e2e.moe_plan(s), cfg)
    for _ in range(steps):
        trainer.train_step()
    with gemm_backend.without_quack():
        for _ in range(steps):
            trainer.train_step()
    torch.cuda.synchronize()
    trainer.batches.close()
    record = cache.tuning_record()
    chosen = json.loads(record.read_text()) if record.exists() else {}
    quack = cache.owned_folder("QUACK_CACHE_DIR")
    if gemm_backend.quack_importable() and quack is not None:
        import quack as quack_package

        product = tuning.product(torch.device("cuda"))
        kernel = tuning.quack_kernel(quack_package.__version__)
        chosen.setdefault(product, {})[kernel] = tuning.quack_records(quack)
    return chosen


def merge(table: dict, product: str, chosen: dict[str, dict]) -> int:
    """Write ``chosen`` (kernel -> bucket -> config) into ``table[product]``; entries written."""
    shipped = table.setdefault(product, {})
    for kernel, buckets in chosen.items():
        shipped.setdefault(kernel, {}).update(buckets)
    return sum(len(b) for b in chosen.values())


def main() -> None:
    args = arguments().parse_args()
    if args.quack_records:
        if not (args.product and args.quack_version):
            sys.exit("--quack-records needs --product and --quack-version (the run's)")
        records = tuning.quack_records(Path(args.quack_records))
        chosen = {args.product: {tuning.quack_kernel(args.quack_version): records}}
    elif args.record:
        chosen = json.loads(Path(args.record).read_text())
    else:
        chosen = {tuned_product(): {}}
        product = next(iter(chosen))
        chosen[product] = tune(args.small, args.steps).get(product, {})
    for product, kernels in sorted(chosen.items()):
        for kernel, buckets in sorted(kernels.items()):
            for bucket, config in sorted(buckets.items()):
                print(f"{product} {kernel} [{bucket}]: {json.dumps(config)}")
    if args.dry_run:
        return
    path = Path(args.table)
    # a new file starts from the shipped table, so a run can write beside the checkout
    table = json.loads((path if path.exists() else tuning.TABLE).read_text())
    for product, kernels in chosen.items():
        if product not in tuning.PRODUCTS:
            sys.exit(f"{args.record}: {product!r} is none of {', '.join(tuning.PRODUCTS)}")
        written = merge(table, product, kernels)
        print(f"{written} entries for {product} written to {path}")
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def tuned_product() -> str:
    """This GPU's product in the table (exits where there is no GPU or it has no entry)."""
    if not torch.cuda.is_available():
        sys.exit("tune_table.py autotunes on a GPU: none is visible (--record merges a record)")
    product = tuning.product(torch.device("cuda"))
    if product is None:
        sys.exit(
            f"{torch.cuda.get_device_name()} is none of {', '.join(tuning.PRODUCTS)}: the table "
            "holds those products only"
        )
    return product


if __name__ == "__main__":
    main()
