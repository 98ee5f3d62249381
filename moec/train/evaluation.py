"""Held-out evaluation during training (``TrainConfig.eval_every``, ``eval_batches``,
``eval_data``; ``moec train --eval-every N --eval-batches M --eval-data SPEC``).

The eval set: ``eval_batches`` fixed batches of ``batch_size`` sequences of ``seq_len`` tokens,
batch i drawn as a pure function of i and :data:`EVAL_SEED` (not the run's seed: runs of other
seeds are scored on the same tokens), the same at every eval point. They come from
``eval_data`` or, by default, the held-out split of the training data, which training never
reads: a built corpus's eval split (``moec data build``), the offline text's held-out tail.
Synthetic tokens and ``--data`` sources other than built corpora have none: without
``eval_data`` there is then no evaluation (:func:`held_out` says why).

An evaluation runs the program in eval mode under ``torch.no_grad()``: each batch as the
training step's microbatches, its loss the LM loss the program returns (next-token
cross-entropy, plus the LM-head z-loss where ``z_loss`` is on, as the training loss), never the
router losses. The eval loss is the mean over the batches (equal sizes: the mean over every
token). The batches are shared out over the data-parallel ranks, rank r taking batches r,
r + dp, ...; every rank runs the same number of forwards, since expert-parallel exchanges need
all of them (a rank out of batches in the last round runs one of its own again and leaves it
out), and the loss sums and counts are all-reduced over the job. Under pipeline parallelism
(``parallel.pp > 1``) each batch runs forward-only through the pipeline schedule
(:meth:`moec.runtime.pipeline.PipelineRuntime.evaluate`): its loss is on the last stage's ranks,
the other ranks add nothing to the sums, and the all-reduce brings the eval loss to every rank,
rank 0 included.

Evaluation changes nothing training reads: the random streams (random routing draws from them)
and the last training forward's aux outputs (the routing statistics of the log points) are
restored afterwards, and the routers' step balance ignores forwards outside training. It reads
the device once per eval point, between steps; the loop times it apart from the steps
(``eval_s``, :mod:`moec.train.timing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from moec.corpus import SourceSpec, TokenCorpus, built_corpus, parse_spec
from moec.data import TextBatches
from moec.runtime.compiled import CompiledModel
from moec.train.config import TrainConfig, flag_of

EVAL_SEED = 1
"""The seed of the eval batches' draws, whatever the run's seed."""

HeldOut = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""Eval batch ``i`` as (inputs, targets) on the host, a pure function of ``i``."""

BatchLoss = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
"""``loss_of(inputs, targets)``: the mean LM loss of a batch's microbatches in eval mode without
gradients (a device scalar), None on ranks that do not hold it (a pipeline's first stages); the
program's mode and the aux outputs of its last training forward are left as they were."""


def held_out(cfg: TrainConfig, vocab: int) -> tuple[HeldOut | None, str]:
    """The eval batches of ``cfg`` for a model of ``vocab`` ids and what they are; None and
    why there are none (see module)."""
    if cfg.eval_data is not None:
        sources = [_eval_split(s) for s in parse_spec(cfg.eval_data, cfg.data_dtype)]
        return _corpus(cfg, sources, vocab), f"--eval-data {cfg.eval_data}"
    if cfg.data is not None:
        sources = parse_spec(cfg.data, cfg.data_dtype)
        lacking = [s.path for s in sources if s.built is None]
        if lacking:
            return None, (
                f"{flag_of('data')} {lacking[0]} has no held-out split (corpora moec data build "
                f"writes have one): give {flag_of('eval_data')} SPEC"
            )
        folders = ", ".join(s.built.corpus for s in sources if s.built is not None)
        return _corpus(cfg, [_eval_split(s) for s in sources], vocab), f"eval split of {folders}"
    if cfg.synthetic:
        return None, f"synthetic tokens have no held-out split: give {flag_of('eval_data')} SPEC"
    text = TextBatches(cfg.batch_size, cfg.seq_len, EVAL_SEED, vocab_size=vocab)
    return text.eval_batch, "held-out 5% of the offline text"


def _eval_split(source: SourceSpec) -> SourceSpec:
    """A built corpus's eval split in place of its train split (its weight kept); any other
    source as it is."""
    if source.built is None:
        return source
    return dataclasses.replace(built_corpus(source.built.corpus).eval, weight=source.weight)


def _corpus(cfg: TrainConfig, sources: list[SourceSpec], vocab: int) -> HeldOut:
    corpus = TokenCorpus(
        sources,
        cfg.batch_size,
        cfg.seq_len,
        vocab,
        EVAL_SEED,
        tokenizer=cfg.tokenizer,
        text_column=cfg.text_column,
    )
    return corpus.batch


def rank_batches(count: int, rank: int, ranks: int) -> list[tuple[int, bool]]:
    """The eval batches data-parallel rank ``rank`` of ``ranks`` runs, as (batch, counted):
    batches ``rank``, ``rank + ranks``, ... below ``count``, padded to as many rounds as the
    busiest rank's with uncounted repeats of one of them (or of batch 0)."""
    rounds = -(-count // ranks)
    own = list(range(rank, count, ranks))
    spare = own[0] if own else 0
    return [(own[i], True) if i < len(own) else (spare, False) for i in range(rounds)]


def compiled_loss(compiled: CompiledModel, microbatches: int) -> BatchLoss:
    """The :data:`BatchLoss` of a program that runs whole in this process (PP = 1): each
    microbatch through ``compiled`` in eval mode."""

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        was_training, aux = compiled.training, compiled.aux_outputs
        compiled.eval()
        try:
            with torch.no_grad():
                losses = [
                    compiled(x, y).detach().double()
                    for x, y in zip(
                        inputs.chunk(microbatches), targets.chunk(microbatches), strict=True
                    )
                ]
        finally:
            compiled.train(was_training)
            compiled.aux_outputs = aux
        return torch.stack(losses).mean()

    return loss_of


class Evaluator:
    """The eval loss of ``loss_of`` (:data:`BatchLoss`) on this data-parallel rank's share of
    the fixed eval batches (see module); ``share``: (this rank's data-parallel index, the
    data-parallel ranks); ``in_job``: the sums are all-reduced over the job's ranks."""

    def __init__(
        self,
        loss_of: BatchLoss,
        batches: HeldOut,
        count: int,
        device: torch.device,
        *,
        share: tuple[int, int] = (0, 1),
        in_job: bool = False,
    ):
        self.loss_of, self.device, self.in_job = loss_of, device, in_job
        # loaded once, on the device: every eval point reads the same tokens
        self.batches = [
            (tuple(t.to(device) for t in batches(i)), counted)
            for i, counted in rank_batches(count, *share)
        ]

    def __call__(self) -> float:
        """The mean LM loss over the eval batches of every data-parallel rank (a collective in
        a job: every rank calls it at the same step); reads the device. The random streams
        (random routing draws from them) are restored afterwards."""
        devices = [self.device] if self.device.type == "cuda" else []
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, batches
        with torch.random.fork_rng(devices):
            for (inputs, targets), counted in self.batches:
                loss = self.loss_of(inputs, targets)
                if loss is not None and counted:
                    loss = loss.double()
                    sums += torch.stack([loss, torch.ones_like(loss)])
        if self.in_job:
            dist.all_reduce(sums)
        total, batches = sums.tolist()
        return total / batches
