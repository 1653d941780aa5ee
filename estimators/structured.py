"""Exact ||J_f(x)||_F^2 for models with local structure, by colouring outputs or inputs.

Outputs whose input supports (receptive fields) are disjoint have vector-Jacobian products
with disjoint supports, so one backward pass with their cotangents summed returns a vector
whose squared norm is the sum of their squared norms. Colour the outputs so that every colour
class has pairwise disjoint supports, and the exact trace costs one vjp per colour instead of
one per output (or per input): the hot loop of dFIL (docs/concepts.md, "dFIL"). Dually, inputs that
reach disjoint sets of outputs share one forward-mode product (jvp); the side with fewer colours
is used, as plain auto picks the smaller of d and m.

Supports come from NaN propagation: an output that depends on input k turns NaN when input k
is NaN, whatever the weights and the point (NaN * 0 is NaN), so a derivative that happens to be
exactly zero cannot hide a dependency. They are found in two exact rounds of batched forward
passes (blocks of inputs, then inputs whose block supports are disjoint, attributed exactly),
the colouring is checked with a sign test on a real sample, and the result is cached per model
and input shape, so an audit detects once and reuses it for every batch.

The search is budgeted: it may take PROBING_SHARE of what the plain exact method (min(d, m)
products on every sample, priced by timing a few products) is expected to take, in process CPU
time; past that it stops and the plain method runs, so looking for structure never adds more than
that share to the cost. Of the two sides, the one whose colour count cannot fall below the other's
colouring is not coloured at all (a column touched by k rows needs k colours).

Registered in the method table of estimators/methods.py as "structured"; "auto" picks it when
it needs fewer products than plain forward or reverse mode.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from splitaudit.estimators.jacobian import (
    DEFAULT_MEMORY_BYTES,
    BatchFn,
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
# The search may take this share of the plain exact method's expected CPU time (module docstring):
# a search that finds nothing adds at most this share; one that finds structure (at most 1/MIN_GAIN
# of the products) leaves the two together at most half the plain method's time.
PROBING_SHARE = 0.25
# Products timed on one sample to price the plain exact method.
TIMED_DIRECTIONS = 16
# Greedy colouring checks its budget once per this many rows.
ROWS_PER_CHECK = 1024
# What a colouring of each side means, for the report.
LOCALITY = {
    "outputs": "each output depends on a local patch of inputs",
    "inputs": "each input reaches a local patch of outputs",
}


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
    colouring = complete_colouring(f, x, plan)
    if colouring is None:
        raise ValueError(
            "the structured method needs local structure (outputs with disjoint input "
            "supports); this model has none: use forward, reverse or auto"
        )
    values = coloured_sq_norm(f, x, colouring, plan.directions_per_chunk(len(x), options.memory_bytes)).sum(0)
    return TraceEstimate(
        values=values, stderr=torch.zeros_like(values), method="structured", exact=True, products=colouring.count
    )


@dataclass(frozen=True)
class Search:
    """What looking for local structure gave: the colouring (None: none is used) and what was found
    or why none is used, with the CPU seconds the search took and the budget it had."""

    colouring: Colouring | None
    reason: str
    seconds: float
    budget: float | None  # None: the search ended before it needed one
    stopped: bool = False  # at its budget, before it could tell


class OverBudget(Exception):
    """The search for local structure ran past its budget."""


class Deadline:
    """Process CPU time since creation against a budget in seconds, which `price` gives when the
    first check asks for it (searches that end at their cheap first looks never pay for pricing)."""

    def __init__(self, price: Callable[[], float] = lambda: math.inf) -> None:
        self.start = time.process_time()
        self.price = price
        self.budget: float | None = None

    @property
    def spent(self) -> float:
        return time.process_time() - self.start

    def check(self) -> None:
        if self.budget is None:
            self.budget = self.price()
        if self.spent > self.budget:
            raise OverBudget


def structured_products(f: BatchFn, x: Tensor, plan: Plan) -> int | None:
    """Products per sample of the structured method, or None when f has no useful local structure
    (or draws random numbers: the support detection compares passes, which draws would confuse)."""
    if is_stochastic(f):
        return None
    colouring = find_colouring(f, x, plan)
    return None if colouring is None else colouring.count


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
    return search_structure(f, x, plan).colouring


def search_structure(f: BatchFn, x: Tensor, plan: Plan) -> Search:
    """The budgeted search for f's local structure at x[0], once per model and input shape (the
    first caller's plan.samples sets the budget)."""
    return cached_per_model("colouring", f, x, lambda: budgeted_search(f, x[0].detach(), plan))


def budgeted_search(f: BatchFn, x0: Tensor, plan: Plan) -> Search:
    """detect_colouring within PROBING_SHARE of the plain exact method's expected CPU time."""
    deadline = Deadline(lambda: PROBING_SHARE * plain_exact_seconds(f, x0, plan))
    try:
        colouring, reason = detect_colouring(f, x0, plan, deadline)
    except OverBudget:
        reason = (
            f"the search for local structure was stopped at its budget, {PROBING_SHARE:.0%} of the CPU time "
            "the plain exact method is expected to take"
        )
        return Search(None, reason, deadline.spent, deadline.budget, stopped=True)
    return Search(colouring, reason, deadline.spent, deadline.budget)


def complete_colouring(f: BatchFn, x: Tensor, plan: Plan) -> Colouring | None:
    """The colouring, searched without a budget where the budgeted search stopped before it could tell
    (the method asked for by name; a worker process, whose budget counts only its own samples)."""
    search = search_structure(f, x, plan)
    if not search.stopped:
        return search.colouring
    return cached_per_model("complete colouring", f, x, lambda: detect_colouring(f, x[0].detach(), plan, Deadline())[0])


def plain_exact_seconds(f: BatchFn, x0: Tensor, plan: Plan) -> float:
    """Expected CPU seconds of min(d, m) products on each of plan.samples samples, priced by timing
    TIMED_DIRECTIONS products on x0 (on its own: an upper bound of a product's share in a batch)."""
    side = "inputs" if plan.d <= plan.m and forward_mode_works(f, x0[None]) else "outputs"
    start = time.process_time()
    like, products = product_fn(f, x0[None], side)
    timed = min(TIMED_DIRECTIONS, like[0].numel())
    products(torch.ones(timed, *like.shape, dtype=like.dtype, device=like.device))
    return (time.process_time() - start) / timed * min(plan.d, plan.m) * plan.samples


def detect_colouring(f: BatchFn, x0: Tensor, plan: Plan, deadline: Deadline) -> tuple[Colouring | None, str]:
    """Detect supports at x0, colour the side whose colour count can be lowest greedily (the other
    too when it could do better), check the colouring with fewer colours: (it, what it gives) or
    (None, why not). Raises OverBudget once the deadline is past."""
    limit = min(plan.d, plan.m) // MIN_GAIN
    none = f"no local structure that would save products (a colouring needs over 1/{MIN_GAIN} of min(d, m) colours)"
    if limit < 1:
        return None, "the model has too few inputs or outputs for local structure to save products"
    with torch.no_grad():
        if not torch.isfinite(f(x0[None])).all():
            return None, "the model's output is not finite at the first sample, where structure is detected"
    per_pass = plan.directions_per_chunk(1, DEFAULT_MEMORY_BYTES)
    if plan.d // BLOCK > MAX_DETECTION_PASSES:
        return None, f"too many inputs ({plan.d}) to look for local structure"
    if mixes_globally(f, x0, plan.m, limit, per_pass):
        return None, none
    supports = input_supports(f, x0, limit, per_pass, deadline)
    if supports is None:
        return None, none
    colouring = fewest_colours(supports, limit, forward_mode_works(f, x0[None]), deadline)
    if colouring is None:
        return None, none
    if not sign_test(f, x0, colouring, per_pass):
        return None, "the structure found failed its check on a real sample (an operator hides a dependency)"
    return colouring, LOCALITY[colouring.side]


def fewest_colours(supports: Tensor, limit: int, forward_mode: bool, deadline: Deadline) -> Colouring | None:
    """The greedy colouring of outputs (rows supports.T) or inputs (rows supports, forward mode only)
    with fewer colours, or None past `limit`. A side needs at least as many colours as its most
    shared column has rows: the side with the lower such bound is coloured first, the other only
    when its bound is below the first's count, and then with that count as its limit."""
    sides = [("outputs", supports.T), ("inputs", supports)][: 2 if forward_mode else 1]
    floors = [_max_count(rows, axis=0) for _, rows in sides]
    best = None
    for floor, (side, rows) in sorted(zip(floors, sides), key=lambda pair: pair[0]):
        bound = limit if best is None else best.count - 1
        if floor > bound:
            continue
        colour = greedy_colouring(rows, bound, deadline)
        if colour is not None:
            best = Colouring(colour, int(colour.max()) + 1, side)
    return best


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


def input_supports(f: BatchFn, x0: Tensor, limit: int, per_pass: int, deadline: Deadline) -> Tensor | None:
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
    superset = nan_reach(f, x0, blocks, per_pass, deadline)[block_of]
    input_colour = greedy_colouring(superset, d, deadline)
    reach = torch.zeros_like(superset)
    for colours in _chunks(torch.arange(int(input_colour.max()) + 1), per_pass):
        groups = input_colour[None, :] == colours[:, None]
        inputs, group = groups.T.nonzero(as_tuple=True)
        reach[inputs] = nan_reach(f, x0, groups, per_pass, deadline)[group] & superset[inputs]
        if min(_max_count(reach[inputs], axis=1), _max_count(reach, axis=0)) > limit:
            return None
    return reach


def _max_count(pattern: Tensor, axis: int) -> int:
    return int(pattern.numpy().sum(axis=axis, dtype=np.int32).max())


def nan_reach(f: BatchFn, x0: Tensor, groups: Tensor, per_pass: int, deadline: Deadline | None = None) -> Tensor:
    """hits[g, j] (bool, CPU): output j is NaN when the inputs in group g are NaN, x0 elsewhere."""
    flat = x0.reshape(-1)
    hits = []
    with torch.no_grad():
        for part in _chunks(groups, per_pass):
            if deadline is not None:
                deadline.check()
            probes = flat.expand(len(part), -1).masked_fill(part.to(flat.device), math.nan)
            hits.append(torch.isnan(f(probes.view(len(part), *x0.shape))).flatten(1).cpu())
    return torch.cat(hits)


def greedy_colouring(supports: Tensor, limit: int, deadline: Deadline | None = None) -> Tensor | None:
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
        if deadline is not None and row % ROWS_PER_CHECK == 0:
            deadline.check()
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
