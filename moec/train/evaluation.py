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
out), and the loss sums and counts are all-reduced over the data-parallel group. Pipelined
plans (``parallel.pp > 1``) do not train through the Trainer, so they are not evaluated here.

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


class Evaluator:
    """The eval loss of ``compiled`` on this rank's share of the fixed eval batches (see
    module); ``group``: the data-parallel process group (None outside a job)."""

    def __init__(
        self,
        compiled: CompiledModel,
        batches: HeldOut,
        count: int,
        microbatches: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ):
        self.compiled, self.microbatches, self.device = compiled, microbatches, device
        self.group = group
        rank, ranks = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
        # loaded once, on the device: every eval point reads the same tokens
        self.batches = [
            (tuple(t.to(device) for t in batches(i)), counted)
            for i, counted in rank_batches(count, rank, ranks)
        ]

    def __call__(self) -> float:
        """The mean LM loss over the eval batches of every data-parallel rank (a collective in
        a job: every rank calls it at the same step); reads the device."""
        compiled = self.compiled
        was_training, aux = compiled.training, compiled.aux_outputs
        devices = [self.device] if self.device.type == "cuda" else []
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, forwards
        compiled.eval()
        try:
            with torch.random.fork_rng(devices), torch.no_grad():
                for (inputs, targets), counted in self.batches:
                    pairs = zip(
                        inputs.chunk(self.microbatches),
                        targets.chunk(self.microbatches),
                        strict=True,
                    )
                    for x, y in pairs:
                        loss = compiled(x, y).detach().double()
                        if counted:
                            sums += torch.stack([loss, torch.ones_like(loss)])
        finally:
            compiled.train(was_training)
            compiled.aux_outputs = aux
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        total, forwards = sums.tolist()
        return total / forwards
