"""Random draws from a generator of their own, so that several threads can initialize at once.

Code run under :func:`private_generator` (a dispatch mode, which holds for the thread that
enters it alone) draws every random tensor from a new CPU ``torch.Generator`` seeded with
``seed``: each aten op tagged ``nondeterministic_seeded`` is given it as its ``generator``.
The values are those the same code draws after ``torch.manual_seed(seed)``: the CPU
generators are one Mersenne twister, and a fresh seed clears the cached normal sample as
``manual_seed`` does. The global generator is neither read nor moved, so other threads may
use it meanwhile.

An op whose overload takes no generator (``torch.randn(size)`` is ``aten.randn.default``;
dropout) raises :class:`UnseededDraw` instead of drawing from the global generator: the
caller then runs the code again under :func:`global_generator`, alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class UnseededDraw(Exception):
    """A random op with no ``generator`` argument was called under :func:`private_generator`.
    Not a ``RuntimeError``: an initializer's own errors are told apart from it."""


class _PrivateGenerator(TorchDispatchMode):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            names = [a.name for a in func._schema.arguments]
            if "generator" not in names:
                raise UnseededDraw(f"{func} takes no generator")
            at = names.index("generator")  # keyword-only but in a few ops (poisson, gamma)
            if at < len(args):
                if args[at] is None:
                    args = (*args[:at], self.generator, *args[at + 1 :])
            elif kwargs.get("generator") is None:
                kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


def private_generator(seed: int) -> TorchDispatchMode:
    """This thread's random draws, while entered, from a generator seeded with ``seed``
    (module docstring)."""
    return _PrivateGenerator(seed)


@contextlib.contextmanager
def global_generator(seed: int) -> Iterator[None]:
    """The global CPU generator seeded with ``seed``, its state restored after (the GPUs' are
    not touched: ``torch.manual_seed`` would seed them). Not safe beside other threads that
    draw from it."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield
