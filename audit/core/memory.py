"""Memory budgets for the networks an audit trains or differentiates through.

Batch sizes are chosen from what one sample actually costs: the bytes autograd saves for the
backward pass, counted with torch's saved-tensor hooks on a small probe batch. A batch then
holds as many samples as fit in ACTIVATION_BUDGET, so a 3x224x224 input gets small batches
and an 8x8 digit keeps the batch size its settings ask for.
"""

from __future__ import annotations

from typing import Callable

import torch

ACTIVATION_BUDGET = 512 * 2**20  # bytes of saved activations per training or inversion step
FORWARD_VALUES = 2**23  # input values per batch of a forward pass without gradients (32 MiB float32)
PROBE_SAMPLES = 2


def saved_bytes(step: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves while `step()` runs (each storage counted once)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[(storage.data_ptr(), tensor.device.index or 0)] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(seen.values())


def per_sample_bytes(step: Callable[[torch.Tensor], object], x: torch.Tensor) -> int:
    """Saved-activation bytes per sample of step(batch), probed on the first PROBE_SAMPLES of x."""
    probe = x[:PROBE_SAMPLES]
    return max(1, saved_bytes(lambda: step(probe)) // len(probe))


def batch_within(per_sample: int, cap: int, budget: int | None = None) -> int:
    """The largest batch (at most cap, at least 1) whose activations fit in the budget
    (ACTIVATION_BUDGET unless given)."""
    return max(1, min(cap, (budget or ACTIVATION_BUDGET) // max(1, per_sample)))


def forward_batch(sample_shape: tuple[int, ...], cap: int) -> int:
    """Batch size for gradient-free forward passes: at most cap, at most FORWARD_VALUES input values."""
    values = 1
    for size in sample_shape:
        values *= size
    return max(1, min(cap, FORWARD_VALUES // max(1, values)))
