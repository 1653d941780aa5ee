"""Exact ||J_f(x)||_F^2 for models with local structure, by colouring the outputs.

Outputs whose input supports (receptive fields) are disjoint have vector-Jacobian products
with disjoint supports, so one backward pass with their cotangents summed returns a vector
whose squared norm is the sum of their squared norms. Colour the outputs so that every colour
class has pairwise disjoint supports, and the exact trace costs one vjp per colour instead of
one per output (or per input): the hot loop of dFIL (DESIGN.md section 4).

Supports come from NaN propagation: an output that depends on input k turns NaN when input k
is NaN, whatever the weights and the point (NaN * 0 is NaN), so a derivative that happens to be
exactly zero cannot hide a dependency. They are found in two exact rounds of batched forward
passes (blocks of inputs, then inputs whose block supports are disjoint, attributed exactly),
the colouring is checked with a sign test on a real sample, and the result is cached per model
and input shape, so an audit detects once and reuses it for every batch.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.func import vjp, vmap

# The structured method is used only when it needs at most min(d, m) / MIN_GAIN products.
MIN_GAIN = 4
# Phase one of detection makes blocks of this many consecutive inputs NaN together.
BLOCK = 8
# Working memory for one batch of probes or products, in bytes.
MEMORY_BUDGET = 256 * 2**20
# Rough activation memory of one forward+backward per sample, in multiples of its input+output.
ACTIVATION_FACTOR = 16
# Sign-test tolerance, the accuracy the method promises: with disjoint supports the two
# squared norms agree to rounding, a coupling the NaN probes missed moves them further.
SIGN_TEST_RTOL = 1e-4

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class OutputColouring:
    """colour[j] for each flattened output j; outputs of one colour have disjoint supports."""

    colour: torch.Tensor
    count: int

    def masks(self, colours: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Cotangents [len(colours), *like.shape[1:]]: 1 on the outputs of each colour, else 0."""
        colour = self.colour.to(like.device)
        hit = colour[None, :] == colours.to(like.device)[:, None]
        return hit.to(like.dtype).view(len(colours), *like.shape[1:])


def structured_sq_norm(f: Fn, x: torch.Tensor) -> torch.Tensor | None:
    """Exact ||J_f(x_i)||_F^2 per sample, or None when f has no useful local structure.

    f maps a batch [B, *in] to [B, *out] sample by sample; the caller falls back to plain
    forward or reverse mode on None.
    """
    colouring = output_colouring(f, x)
    if colouring is None:
        return None
    return coloured_sq_norm(f, x, colouring)


def coloured_sq_norm(f: Fn, x: torch.Tensor, colouring: OutputColouring) -> torch.Tensor:
    """sum over colours c of ||J^T 1_c||^2, per sample: one vjp per colour, vmapped in chunks."""
    out, pullback = vjp(f, x)
    total = torch.zeros(len(x), dtype=out.dtype, device=out.device)
    colours = torch.arange(colouring.count, device=out.device)
    for chunk in _chunks(colours, _products_per_pass(x, out)):
        cotangents = colouring.masks(chunk, out)[:, None].expand(-1, *out.shape)
        (grads,) = vmap(pullback)(cotangents)
        total += grads.pow(2).flatten(2).sum(dim=(0, 2))
    return total


_cache: dict[tuple, tuple[Callable[[], object], OutputColouring | None]] = {}


def output_colouring(f: Fn, x: torch.Tensor) -> OutputColouring | None:
    """The colouring of f's outputs for inputs shaped like x[0], computed once per model+shape."""
    key = (id(f), tuple(x.shape[1:]))
    hit = _cache.get(key)
    if hit is not None and hit[0]() is f:
        return hit[1]
    colouring = detect_colouring(f, x[0].detach())
    try:
        _cache[key] = (weakref.ref(f), colouring)
        weakref.finalize(f, _cache.pop, key, None)
    except TypeError:  # f cannot be weakly referenced: nothing is cached
        pass
    return colouring


def detect_colouring(f: Fn, x0: torch.Tensor) -> OutputColouring | None:
    """Detect supports at x0, colour the outputs greedily and check the colouring, or None."""
    with torch.no_grad():
        base = f(x0[None])
    if not torch.isfinite(base).all():
        return None
    limit = min(x0.numel(), base[0].numel()) // MIN_GAIN
    if limit < 1:
        return None
    supports = input_supports(f, x0, limit)
    if supports is None:
        return None
    colour = greedy_colouring(supports.T.contiguous(), limit)
    if colour is None:
        return None
    colouring = OutputColouring(colour=colour, count=int(colour.max()) + 1)
    return colouring if sign_test(f, x0, colouring) else None


def input_supports(f: Fn, x0: torch.Tensor, limit: int) -> torch.Tensor | None:
    """reach[k, j] (bool, [d, m]): output j depends on input k. None past `limit` colours.

    Round one makes blocks of BLOCK consecutive inputs NaN: each input's outputs lie within its
    block's. Round two makes NaN, together, inputs whose block sets are disjoint (a greedy
    colouring of the inputs): an output that turns NaN then belongs to exactly one of them.
    An input reaching more than `limit` outputs forces more than `limit` output colours (they
    all conflict), so detection stops there.
    """
    d = x0.numel()
    block_of = torch.arange(d) // BLOCK
    blocks = block_of[None, :] == torch.arange(int(block_of[-1]) + 1)[:, None]
    superset = nan_reach(f, x0, blocks)[block_of]
    input_colour = greedy_colouring(superset, d)
    reach = torch.zeros_like(superset)
    for colours in _chunks(torch.arange(int(input_colour.max()) + 1), _probes_per_pass(x0)):
        groups = input_colour[None, :] == colours[:, None]
        hits = nan_reach(f, x0, groups)
        inputs, group = groups.T.nonzero(as_tuple=True)
        reach[inputs] = hits[group] & superset[inputs]
        if int(reach[inputs].sum(dim=1).max()) > limit:
            return None
    return reach


def nan_reach(f: Fn, x0: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """hits[g, j] (bool, on CPU): output j is NaN when the inputs in group g are NaN, x0 elsewhere."""
    flat = x0.reshape(-1)
    hits = []
    with torch.no_grad():
        for part in _chunks(groups, _probes_per_pass(x0)):
            probes = flat.expand(len(part), -1).masked_fill(part.to(flat.device), math.nan)
            hits.append(torch.isnan(f(probes.view(len(part), *x0.shape))).flatten(1).cpu())
    return torch.cat(hits)


def greedy_colouring(supports: torch.Tensor, limit: int) -> torch.Tensor | None:
    """Colour the rows of a boolean matrix so that rows sharing a column differ in colour.

    Greedy in row order: each row takes the smallest colour not yet used on any of its
    columns. Returns colour per row (long, CPU), or None when more than `limit` are needed.
    """
    rows, cols = (a.numpy() for a in supports.cpu().nonzero(as_tuple=True))
    starts = np.searchsorted(rows, np.arange(supports.shape[0] + 1))
    used = np.zeros((supports.shape[1], limit + 1), dtype=bool)  # used[k, c]: colour c touches column k
    colour = np.zeros(supports.shape[0], dtype=np.int64)
    count = 0
    for row in range(supports.shape[0]):
        touched = cols[starts[row]:starts[row + 1]]
        c = int(np.argmin(used[touched, : count + 1].any(axis=0)))
        if c == limit:
            return None
        used[touched, c] = True
        colour[row] = c
        count = max(count, c + 1)
    return torch.from_numpy(colour)


def sign_test(f: Fn, x0: torch.Tensor, colouring: OutputColouring) -> bool:
    """Check that each colour class's vjps are orthogonal at x0, as disjoint supports make them.

    ||J^T (s * 1_c)||^2 is the same for all signs s exactly when the cross terms vanish; a
    dependency the NaN probes missed (an operator that masks NaN) shows up as a difference
    between all-ones and random signs.
    """
    x = x0[None]
    out, pullback = vjp(f, x)
    signs = torch.randint(0, 2, out.shape, device=out.device, generator=_generator(out.device)) * 2 - 1
    colours = torch.arange(colouring.count, device=out.device)
    for chunk in _chunks(colours, _products_per_pass(x, out)):
        ones = colouring.masks(chunk, out)[:, None]
        (grads,) = vmap(pullback)(torch.cat([ones, ones * signs]))
        plain, signed = grads.pow(2).flatten(1).sum(dim=1).split(len(chunk))
        if not torch.allclose(plain, signed, rtol=SIGN_TEST_RTOL, atol=0.0):
            return False
    return True


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _chunks(items: torch.Tensor, per_pass: int) -> tuple[torch.Tensor, ...]:
    """items split into the fewest passes of at most per_pass, of near-equal sizes."""
    return torch.tensor_split(items, math.ceil(len(items) / per_pass))


def _probes_per_pass(x0: torch.Tensor) -> int:
    """How many NaN-probed copies of x0 fit one forward pass within the memory budget."""
    return max(1, MEMORY_BUDGET // (x0.numel() * x0.element_size() * ACTIVATION_FACTOR))


def _products_per_pass(x: torch.Tensor, out: torch.Tensor) -> int:
    """How many vjps over the whole batch fit one vmapped backward within the memory budget."""
    per_product = (x.numel() + out.numel()) * x.element_size() * ACTIVATION_FACTOR
    return max(1, MEMORY_BUDGET // per_product)
