"""Reproducible random draws: a stochastic encoder (dropout, internal noise) draws from torch's global
generator, so every job that runs one seeds that generator for itself and leaves the caller's as it was."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def seeded_draws(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """torch's global generator (of `device`) seeded with `seed` inside and restored after: a
    stochastic encoder's draws, which come from it, are then reproducible wherever a job runs,
    without changing the caller's random state."""
    device = torch.device(device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda" if cuda else "cpu"):
        torch.manual_seed(seed)
        yield
