"""Exact ||J_f(x)||_F^2 for models with local structure, by colouring outputs or inputs.

Outputs whose input supports (receptive fields) are disjoint have vector-Jacobian products
with disjoint supports, so one backward pass with their cotangents summed returns a vector
whose squared norm is the sum of their squared norms. Colour the outputs so that every colour
class has pairwise disjoint supports, and the exact trace costs one vjp per colour instead of
one per output (or per input): the hot loop of dFIL (docs/design.md section 4). Dually, inputs that
reach disjoint sets of outputs share one forward-mode product (jvp); the side with fewer colours
is used, as plain auto picks the smaller of d and m.

Supports come from NaN propagation: an output that depends on input k turns NaN when input k
is NaN, whatever the weights and the point (NaN * 0 is NaN), so a derivative that happens to be
exactly zero cannot hide a dependency. They are found in two exact rounds of batched forward
passes (blocks of inputs, then inputs whose block supports are disjoint, attributed exactly),
the colouring is checked with a sign test on a real sample, and the result is cached per model
and input shape, so an audit detects once and reuses it for every batch.

Registered in the method table of estimators/methods.py as "structured"; "auto" picks it when
it needs fewer products than plain forward or reverse mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from splitaudit.estimators.jacobian import (
    DEFAULT_MEMORY_BYTES,
    BatchFn,
    Method,
    Plan,
    TraceEstimate,
    TraceOptions,
    _squared_norms,
    cached_per_model,
    forward_mode_works,
    is_stochastic,
    product_fn,
    rademacher,
)

# The structured method applies only when it needs at most min(d, m) / MIN_GAIN products.
MIN_GAIN = 4
# Round one of detection makes blocks of this many consecutive inputs NaN together.
BLOCK = 8
# Sign-test tolerance, the accuracy the method promises: with disjoint supports the two
# squared norms agree to rounding, a coupling the NaN probes missed moves them further.
SIGN_TEST_RTOL = 1e-4
# Detection costs about d / BLOCK single-sample forward passes: beyond this many it costs more
# than the randomised estimate it would replace, and is not attempted.
MAX_DETECTION_PASSES = 4096
# Single inputs made NaN by the first look for global mixing.
MIXING_PROBES = 8


@dataclass(frozen=True)
class Colouring:
    """colour[i] for each flattened output (side "outputs": one vjp per colour) or input (side
    "inputs": one jvp per colour); members of one colour have disjoint supports."""

    colour: Tensor
    count: int
    side: str

    def masks(self, colours: Tensor, like: Tensor) -> Tensor:
        """Directions [len(colours), *like.shape[1:]]: 1 on the members of each colour, else 0."""
        hit = self.colour.to(like.device)[None, :] == colours.to(like.device)[:, None]
        return hit.to(like.dtype).view(len(colours), *like.shape[1:])


def structured_trace(f: BatchFn, x: Tensor, options: TraceOptions, plan: Plan) -> TraceEstimate:
    """Exact ||J_f(x_i)||_F^2 per sample with one product per colour."""
    colouring = find_colouring(f, x, plan)
    if colouring is None:
        raise ValueError(
            "the structured method needs local structure (outputs with disjoint input "
            "supports); this model has none: use forward, reverse or auto"
        )
    values = coloured_sq_norm(f, x, colouring, plan.directions_per_chunk(len(x), options.memory_bytes)).sum(0)
    return TraceEstimate(
        values=values, stderr=torch.zeros_like(values), method="structured", exact=True, products=colouring.count
    )


def structured_products(f: BatchFn, x: Tensor, plan: Plan) -> int | None:
    """Products per sample of the structured method, or None when f has no useful local structure
    (or draws random numbers: the support detection compares passes, which draws would confuse)."""
    if is_stochastic(f):
        return None
    colouring = find_colouring(f, x, plan)
    return None if colouring is None else colouring.count


# Colours either side; declared "inputs" so that its cross-check takes reverse-mode probes, which
# every differentiable model has (forward mode may be missing).
STRUCTURED = Method("structured", "inputs", structured_trace, structured_products)


def coloured_sq_norm(f: BatchFn, x: Tensor, colouring: Colouring, per_pass: int, signs: Tensor | None = None) -> Tensor:
    """[count, N]: ||J^T 1_c||^2 (outputs) or ||J 1_c||^2 (inputs) for each colour c and sample,
    products vmapped over per_pass colours at a time; `signs` multiplies the directions."""
    like, products = product_fn(f, x, colouring.side)
    norms = []
    for chunk in _chunks(torch.arange(colouring.count, device=like.device), per_pass):
        directions = colouring.masks(chunk, like)[:, None]
        if signs is not None:
            directions = directions * signs
        norms.append(_squared_norms(products(directions.expand(-1, *like.shape).contiguous())))
    return torch.cat(norms).detach()


def find_colouring(f: BatchFn, x: Tensor, plan: Plan) -> Colouring | None:
    """f's colouring for inputs shaped like x[0], computed once per model and shape."""
    return cached_per_model("colouring", f, x, lambda: detect_colouring(f, x[0].detach(), plan))


def detect_colouring(f: BatchFn, x0: Tensor, plan: Plan) -> Colouring | None:
    """Detect supports at x0, colour outputs and inputs greedily, check the side with fewer
    colours, or None."""
    limit = min(plan.d, plan.m) // MIN_GAIN
    if limit < 1:
        return None
    with torch.no_grad():
        if not torch.isfinite(f(x0[None])).all():
            return None
    per_pass = plan.directions_per_chunk(1, DEFAULT_MEMORY_BYTES)
    if plan.d // BLOCK > MAX_DETECTION_PASSES or mixes_globally(f, x0, plan.m, limit, per_pass):
        return None
    supports = input_supports(f, x0, limit, per_pass)
    if supports is None:
        return None
    sides = (("outputs", supports.T), ("inputs", supports))[: 2 if forward_mode_works(f, x0[None]) else 1]
    found = [
        Colouring(colour, int(colour.max()) + 1, side)
        for side, rows in sides
        if (colour := greedy_colouring(rows, limit)) is not None
    ]
    if not found:
        return None
    colouring = min(found, key=lambda c: c.count)
    return colouring if sign_test(f, x0, colouring, per_pass) else None


def mixes_globally(f: BatchFn, x0: Tensor, m: int, limit: int, per_pass: int) -> bool:
    """A cheap first look (one batched pass): MIXING_PROBES single inputs made NaN at spread positions.

    When one of them reaches more than `limit` outputs, outputs need more than `limit` colours;
    when on average they reach a fraction q of the outputs, an average output depends on about
    q d inputs, and inputs need more than `limit` colours once q d > limit. Attention, global
    pooling and dense layers are recognised here instead of after the two rounds of detection.
    """
    d = x0.numel()
    inputs = torch.linspace(0, d - 1, min(d, MIXING_PROBES)).long()
    groups = torch.zeros(len(inputs), d, dtype=torch.bool)
    groups[torch.arange(len(inputs)), inputs] = True
    reach = nan_reach(f, x0, groups, per_pass).sum(1).double()
    return bool(reach.max() > limit) and bool(reach.mean() / m * d > limit)


def input_supports(f: BatchFn, x0: Tensor, limit: int, per_pass: int) -> Tensor | None:
    """reach[k, j] (bool, [d, m]): output j depends on input k. None past `limit` colours.

    Round one makes blocks of BLOCK consecutive inputs NaN: each input's outputs lie within its
    block's. Round two makes NaN, together, inputs whose block sets are disjoint (a greedy
    colouring of the inputs): an output that turns NaN then belongs to exactly one of them.
    An input reaching more than `limit` outputs forces more than `limit` output colours (they
    all conflict with each other), an output depending on more than `limit` inputs as many
    input colours: detection stops once both are seen.
    """
    d = x0.numel()
    block_of = torch.arange(d) // BLOCK
    blocks = block_of[None, :] == torch.arange(int(block_of[-1]) + 1)[:, None]
    superset = nan_reach(f, x0, blocks, per_pass)[block_of]
    input_colour = greedy_colouring(superset, d)
    reach = torch.zeros_like(superset)
    for colours in _chunks(torch.arange(int(input_colour.max()) + 1), per_pass):
        groups = input_colour[None, :] == colours[:, None]
        inputs, group = groups.T.nonzero(as_tuple=True)
        reach[inputs] = nan_reach(f, x0, groups, per_pass)[group] & superset[inputs]
        if min(_max_count(reach[inputs], axis=1), _max_count(reach, axis=0)) > limit:
            return None
    return reach


def _max_count(pattern: Tensor, axis: int) -> int:
    return int(pattern.numpy().sum(axis=axis, dtype=np.int32).max())


def nan_reach(f: BatchFn, x0: Tensor, groups: Tensor, per_pass: int) -> Tensor:
    """hits[g, j] (bool, CPU): output j is NaN when the inputs in group g are NaN, x0 elsewhere."""
    flat = x0.reshape(-1)
    hits = []
    with torch.no_grad():
        for part in _chunks(groups, per_pass):
            probes = flat.expand(len(part), -1).masked_fill(part.to(flat.device), math.nan)
            hits.append(torch.isnan(f(probes.view(len(part), *x0.shape))).flatten(1).cpu())
    return torch.cat(hits)


def greedy_colouring(supports: Tensor, limit: int) -> Tensor | None:
    """Colour the rows of a boolean matrix so that rows sharing a column differ in colour.

    Greedy in row order: each row takes the smallest colour not yet used on any of its
    columns. Returns the colour of each row (long, CPU), or None when more than `limit` are needed.
    """
    rows, cols = (a.numpy() for a in supports.cpu().nonzero(as_tuple=True))
    starts = np.searchsorted(rows, np.arange(supports.shape[0] + 1))
    used = np.zeros((supports.shape[1], limit + 1), dtype=bool)  # used[k, c]: colour c is on column k
    colour = np.zeros(supports.shape[0], dtype=np.int64)
    count = 0
    for row in range(supports.shape[0]):
        touched = cols[starts[row] : starts[row + 1]]
        c = int(np.argmin(used[touched, : count + 1].any(axis=0)))
        if c == limit:
            return None
        used[touched, c] = True
        colour[row] = c
        count = max(count, c + 1)
    return torch.from_numpy(colour)


def sign_test(f: BatchFn, x0: Tensor, colouring: Colouring, per_pass: int) -> bool:
    """Check that each colour class's products are orthogonal at x0, as disjoint supports make them.

    ||J^T (s * 1_c)||^2 (or ||J (s * 1_c)||^2) is the same for all signs s exactly when the cross
    terms vanish; a dependency the NaN probes missed (an operator that masks NaN) shows up as a
    difference between all-ones and random signs.
    """
    x = x0[None]
    like = x if colouring.side == "inputs" else f(x)
    signs = rademacher(like.shape, like, torch.Generator(device=like.device).manual_seed(0))
    plain = coloured_sq_norm(f, x, colouring, per_pass)
    signed = coloured_sq_norm(f, x, colouring, per_pass, signs)
    return torch.allclose(plain, signed, rtol=SIGN_TEST_RTOL, atol=0.0)


def _chunks(items: Tensor, per_pass: int) -> tuple[Tensor, ...]:
    """items split into the fewest passes of at most per_pass, of near-equal sizes."""
    return torch.tensor_split(items, max(1, math.ceil(len(items) / per_pass)))
