"""Early stopping on a signal the trainer itself can observe (never the targets).

Every iterative attack trains until what it can measure without the private data (a held-out
slice of its own aux data, or its optimisation objective) has stopped improving, with its
iteration or epoch count kept as a cap; the prior's score network stops on its held-out
score-matching loss alike. `Plateau` is that bookkeeping, shared by all of them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

MIN_PATIENCE_STEPS = 200  # optimiser steps the patience spans at least (see epochs_of_patience)
STOPPED_BY_PLATEAU = "plateau"  # the signal did not improve for `patience` evaluations
STOPPED_BY_CAP = "cap"  # the iteration/epoch cap came first


class Plateau:
    """The best value of a signal (lower is better), when it was seen, and the state kept then.

    `update(step, value, state)` records one evaluation and says whether to stop: after
    `patience` evaluations in a row that did not improve on the best by more than
    `min_improvement` (relative: a new best must be below best x (1 - min_improvement)).
    `state` is called only on a new best (a snapshot is a copy of the networks' weights).
    """

    def __init__(self, patience: int, min_improvement: float = 0.0) -> None:
        if patience < 1 or not 0 <= min_improvement < 1:
            raise ValueError(
                f"Plateau needs patience >= 1 and 0 <= min_improvement < 1, got {patience}, {min_improvement}"
            )
        self.patience, self.min_improvement = patience, min_improvement
        self.best, self.best_step, self.best_state = math.inf, 0, None
        self.last_step, self.stale = 0, 0
        self.history: list[tuple[int, float]] = []  # (step, value) of every evaluation: the signal's curve

    def update(self, step: int, value: float, state: Callable[[], Any] | None = None) -> bool:
        """Record the signal at `step`; True when it has plateaued (time to stop). A NaN never improves."""
        self.last_step = step
        self.history.append((step, float(value)))
        if value < self.best * (1 - self.min_improvement):
            self.best, self.best_step, self.stale = float(value), step, 0
            self.best_state = state() if state is not None else None
        else:
            self.stale += 1
        return self.stopped

    @property
    def stopped(self) -> bool:
        return self.stale >= self.patience

    def details(self, unit: str) -> dict[str, Any]:
        """What ran and why it ended, for an attack's report details (`unit`: "epochs", "iterations"...)."""
        return {
            f"{unit}_trained": self.last_step,
            f"best_{unit.rstrip('s')}": self.best_step,
            "stopped_by": STOPPED_BY_PLATEAU if self.stopped else STOPPED_BY_CAP,
        }


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    """Optimiser steps in one shuffled pass over n_train samples (a last batch of one sample is
    dropped: batch norm needs two)."""
    full, rest = divmod(n_train, batch_size)
    return full + (rest >= 2)


def epochs_of_patience(patience: int, steps: int, min_steps: int = MIN_PATIENCE_STEPS) -> int:
    """Epochs of patience for a training of `steps` optimiser steps an epoch: `patience`, or more
    where that many epochs hold fewer than `min_steps` steps. On small aux data an epoch is a step
    or two, and 8 epochs of patience stopped the decoder after about 20 steps, above the mean guess
    (90 aux samples; benchmarks/RESULTS.md, decoder patience)."""
    return max(patience, math.ceil(min_steps / max(1, steps)))


def snapshot(*modules: nn.Module) -> Callable[[], list[dict]]:
    """A `state` for Plateau.update: copies of the modules' weights (and batch-norm statistics)."""
    return lambda: [copy.deepcopy(m.state_dict()) for m in modules]


def restore(state: list[dict] | None, *modules: nn.Module) -> None:
    """Load a snapshot(...) back into the same modules; an error when there is none (the signal
    was never finite: the training diverged, and the attack must fail rather than report)."""
    if state is None:
        raise RuntimeError("its early-stopping signal was never finite (the training diverged)")
    for module, weights in zip(modules, state):
        module.load_state_dict(weights)


@contextmanager
def evaluating(*modules: nn.Module) -> Iterator[None]:
    """The modules in eval mode (batch norm on its running statistics, no dropout) while a signal is
    measured mid-training, each put back in the mode it had."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
