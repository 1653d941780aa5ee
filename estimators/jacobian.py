"""Per-sample squared Frobenius norm of an encoder's Jacobian, ||J_f(x)||_F^2.

This is the hot loop of dFIL (Maeng et al., NeurIPS 2023, Eq. 4-5): for z = f(x) + N(0, sigma^2 I) the Fisher
information is J^T J / sigma^2, so dFIL(x) = ||J(x)||_F^2 / (d sigma^2).

Every method reduces to sums of squared Jacobian products over a set of directions:
- exact forward mode: sum_k ||J e_k||^2 over the d input basis vectors (torch.func.jvp, vmapped);
- exact reverse mode: sum_j ||J^T e_j||^2 over the m output basis vectors (torch.func.vjp, vmapped);
- Hutchinson: E_v ||J v||^2 = ||J||_F^2 for Rademacher v (E[v v^T] = I), with its standard error
  and a stopping rule on the relative standard error;
- finite differences for black-box models: J v ~ (f(x + h v) - f(x - h v)) / 2h over the basis or
  Rademacher probes, through a function that needs no gradients, at two steps h and 4h on the same
  directions; their difference is the truncation error carried with the estimate (see
  finite_difference_trace), and h is chosen by measurement on a pilot (choose_fd_step).
Samples are batched (vmap over directions, one call over all samples); directions are chunked to a
memory budget. Tensors stay on x's device, so the same code runs on CPU and CUDA.

Stochastic encoders (f draws random numbers: dropout, internal noise; `is_stochastic`): every
vmapped product runs with randomness="different", so each product sees its own draw of f's
randomness, frozen between the forward pass and the derivative; reverse-mode products of a
stochastic f also run their forward pass per product. ||J_draw v||^2 is then unbiased for
E_draws ||J v||^2, and every sum or mean above is unbiased for E_draws ||J||_F^2 (each draw
independent of x and of the direction); an "exact" method is exact per draw only.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.func import jvp, vjp, vmap

BatchFn = Callable[[Tensor], Tensor]

DEFAULT_MEMORY_BYTES = 256 * 2**20
FD_BASIS_MAX_DIRECTIONS = 512  # black-box: exact basis up to this many inputs, Hutchinson probes above
FD_STEP_RATIO = 4.0  # the coarse finite-difference step is this many times the fine one
FD_LADDER_STEPS = 7  # steps tried on the pilot: eps^(1/3) * scale, then each FD_STEP_RATIO times smaller
FD_PILOT_SAMPLES, FD_PILOT_DIRECTIONS = 8, 16
# Relative change between two steps that float32 rounding alone explains: about 40 eps^(2/3), the
# rounding error of a central difference at the ladder's coarsest step (eps^(1/3) times the scale),
# amplified by the forward pass. At 1e-4 (4 eps^(2/3)) a smooth depthwise block's pilot read 1.35e-4
# on an AVX2 CPU (1.5e-4 at the coarsest pair: rounding already dominates there) and its black-box
# bound was marked approximate, failing the gate; AVX-512 kernels had read under 1e-4. A change this
# small bounds nothing loosely: the run carries its own two-step difference into the interval.
FD_ROUNDING_FLOOR = 1e-3
FD_CONVERGENCE = 0.5  # the chosen pair must change at most this fraction of the coarsest pair's change
FD_MAX_RELATIVE_ERROR = 0.25  # beyond this the two-step difference is no credible error bound
MIN_DIRECTIONS_PER_CHUNK = 8


@dataclass(frozen=True)
class TraceOptions:
    """Knobs shared by the methods. rtol/min_probes/max_probes apply to random probes only."""

    memory_bytes: int = DEFAULT_MEMORY_BYTES
    rtol: float = 0.05
    min_probes: int = 8
    max_probes: int = 256
    fd_step: float | None = None  # None: chosen by measurement (choose_fd_step)
    fd_directions: str = "auto"  # "basis", "random", or "auto" (basis up to FD_BASIS_MAX_DIRECTIONS)
    generator: torch.Generator | None = None


@dataclass
class TraceEstimate:
    """||J(x_i)||_F^2 per sample with its standard error (0 for exact methods)."""

    values: Tensor
    stderr: Tensor
    method: str
    exact: bool
    products: int  # Jacobian products per sample (directions or probes)
    fd_step: float | None = None
    fd_error: Tensor | None = None  # finite differences: |trace at FD_STEP_RATIO * fd_step - trace at fd_step|
    fd_choice: "StepChoice | None" = None  # finite differences: the pilot that chose fd_step, when one ran
    draws: int = 1  # independent repetitions over a stochastic encoder's draws averaged per sample

    def to(self, device) -> "TraceEstimate":
        fd_error = None if self.fd_error is None else self.fd_error.to(device)
        return dataclasses.replace(
            self, values=self.values.to(device), stderr=self.stderr.to(device), fd_error=fd_error
        )


@dataclass(frozen=True)
class Plan:
    """Sizes measured once per call: input and output dimensions, memory per product, and how many
    samples the trace is taken on (what a plain exact method would cost scales with it)."""

    d: int
    m: int
    bytes_per_product: int
    samples: int = 1

    def directions_per_chunk(self, n_samples: int, budget: int) -> int:
        return max(1, budget // (self.bytes_per_product * max(1, n_samples)))


def concatenated(parts: list[TraceEstimate]) -> TraceEstimate:
    """One estimate from estimates on consecutive batches of samples (same method)."""
    return TraceEstimate(
        values=torch.cat([p.values for p in parts]),
        stderr=torch.cat([p.stderr for p in parts]),
        method=parts[0].method,
        exact=parts[0].exact,
        products=max(p.products for p in parts),
        fd_step=parts[0].fd_step,
        fd_error=None if parts[0].fd_error is None else torch.cat([p.fd_error for p in parts]),
        fd_choice=parts[0].fd_choice,
        draws=parts[0].draws,
    )


def measure_plan(f: BatchFn, x: Tensor, differentiable: bool = True) -> Plan:
    """d, m and the bytes one product costs per sample (what autograd saves, else input + output).

    The saved-tensor size of one extra sample is a model-agnostic proxy for the activations a
    vmapped product keeps alive.
    """
    pair = x[:1].detach().expand(2, *x.shape[1:])
    one, two = _saved_bytes(f, pair[:1], differentiable), _saved_bytes(f, pair, differentiable)
    d = x[0].numel()
    m = one[1]
    floor = 4 * (d + m) * x.element_size()
    return Plan(d=d, m=m, bytes_per_product=max(floor, two[0] - one[0]), samples=len(x))


def _saved_bytes(f: BatchFn, x: Tensor, differentiable: bool) -> tuple[int, int]:
    """(bytes autograd saves in a forward pass of x, output size per sample)."""
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.no_grad() if not differentiable else torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = f(x.clone().requires_grad_(differentiable))
    return total, out[0].numel()


# --- exact methods ----------------------------------------------------------------------------


def forward_trace(f: BatchFn, x: Tensor, options: TraceOptions, plan: Plan) -> TraceEstimate:
    """sum_k ||J e_k||^2 over the input basis: d forward-mode products per sample."""
    values = _basis_sum(
        lambda v: _jvp_products(f, x, v), plan.d, x, plan.directions_per_chunk(len(x), options.memory_bytes)
    )
    return _exact(values, "forward", plan.d)


def forward_products(f: BatchFn, x: Tensor, plan: Plan) -> int | None:
    """forward_trace's cost: d products per sample, where the model has forward-mode derivatives."""
    return plan.d if forward_mode_works(f, x) else None


def reverse_products(f: BatchFn, x: Tensor, plan: Plan) -> int:
    """reverse_trace's cost: m products per sample."""
    return plan.m


def never_exact(f: BatchFn, x: Tensor, plan: Plan) -> None:
    """The cost model of a randomised method: never one "auto" picks as exact."""
    return None


def reverse_trace(f: BatchFn, x: Tensor, options: TraceOptions, plan: Plan) -> TraceEstimate:
    """sum_j ||J^T e_j||^2 over the output basis: m reverse-mode products per sample."""
    out, pullback = vjp(f, x)
    values = _basis_sum(
        lambda u: vmap(pullback)(u)[0], plan.m, out, plan.directions_per_chunk(len(x), options.memory_bytes)
    )
    return _exact(values.detach(), "reverse", plan.m)


def _basis_sum(
    products: Callable[[Tensor], Tensor], n: int, like: Tensor, chunk: int, squares: Callable | None = None
) -> Tensor:
    """sum over the n basis vectors of the space of like[0] of ||products(e)||^2, per sample
    (squares turns products [k, N, ...] into squared norms [k, N, ...]; default _squared_norms)."""
    squares = squares or _squared_norms
    total = torch.zeros((), dtype=like.dtype, device=like.device)
    for start in range(0, n, chunk):
        directions = _basis(start, min(n, start + chunk), like)
        total = total + squares(products(directions)).sum(0)
    return total


def _basis(start: int, stop: int, like: Tensor) -> Tensor:
    """Basis vectors e_start..e_stop-1 of like[0]'s space, one copy per sample of like.

    Materialised (not a stride-0 view): vmapped convolutions run about twice as fast on it."""
    eye = torch.zeros(stop - start, like[0].numel(), dtype=like.dtype, device=like.device)
    eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
    return eye.view(stop - start, 1, *like.shape[1:]).expand(-1, *like.shape).contiguous()


def _exact(values: Tensor, name: str, products: int) -> TraceEstimate:
    return TraceEstimate(values=values, stderr=torch.zeros_like(values), method=name, exact=True, products=products)


# --- random probes (Hutchinson) ---------------------------------------------------------------


def hutchinson_trace(f: BatchFn, x: Tensor, options: TraceOptions, plan: Plan) -> TraceEstimate:
    """E_v ||J v||^2 with Rademacher v (forward-mode products), until stderr/mean <= rtol.

    Models with an operator that has no forward-mode derivative (PyTorch's fused CPU attention
    in a TorchScript trace) use reverse-mode probes, E_u ||J^T u||^2 = ||J||_F^2 as well."""
    like, products = product_fn(f, x, "inputs" if forward_mode_works(f, x) else "outputs")
    chunk = plan.directions_per_chunk(len(x), options.memory_bytes)
    values, stderr, probes = _probe_mean(products, like, options, chunk)
    return TraceEstimate(values=values, stderr=stderr, method="hutchinson", exact=False, products=probes)


def _probe_mean(
    products: Callable[[Tensor], Tensor], x: Tensor, options: TraceOptions, chunk: int, squares: Callable | None = None
) -> tuple[Tensor, Tensor, int]:
    """Mean and standard error of ||J v||^2 over independent Rademacher probes per sample
    (squares as in _basis_sum: several squared norms per probe share its stopping rule).

    Probes are added in rounds (min_probes first, then doubling the count, at most `chunk` per
    round); the loop stops once every sample's standard error is at most rtol times its mean,
    or at max_probes.
    """
    squares = squares or _squared_norms
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    total_sq = torch.zeros_like(total)
    count = 0
    while count < options.max_probes:
        n = min(chunk, max(options.min_probes - count, count, 1), options.max_probes - count)
        probe = rademacher((n, *x.shape), x, options.generator)
        sq = squares(products(probe)).double()
        total, total_sq, count = total + sq.sum(0), total_sq + sq.pow(2).sum(0), count + n
        mean, stderr = _mean_stderr(total, total_sq, count)
        if bool((stderr <= options.rtol * mean).all()):
            break
    return mean.to(x.dtype), stderr.to(x.dtype), count


def _mean_stderr(total: Tensor, total_sq: Tensor, count: int) -> tuple[Tensor, Tensor]:
    mean = total / count
    if count < 2:
        return mean, torch.full_like(mean, math.inf)
    variance = ((total_sq - count * mean.pow(2)) / (count - 1)).clamp(min=0)
    return mean, (variance / count).sqrt()


def rademacher(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Independent +-1 entries with like's dtype and device."""
    bits = torch.randint(0, 2, shape, generator=generator, device=like.device)
    return (2 * bits - 1).to(like.dtype)


# --- black-box: central finite differences ----------------------------------------------------


def finite_difference_trace(f: BatchFn, x: Tensor, options: TraceOptions, plan: Plan) -> TraceEstimate:
    """Central differences over the input basis (exact up to truncation), or Rademacher probes when
    d is large, at the step h = options.fd_step (jacobian_trace chooses it when not given) and at
    FD_STEP_RATIO * h on the same directions. Needs forward passes only.

    The values are those at h; fd_error is |trace(FD_STEP_RATIO h) - trace(h)| per sample, which
    bounds the truncation error at h wherever it shrinks at least like sqrt(h) (a kink within the
    step of x: error ~ h; a smooth model: ~ h^2). Kinks bias central differences low (the
    difference quotient averages the slopes on both sides of a kink, and ||mean||^2 <= mean ||.||^2),
    the direction that would make the bound too optimistic; the caller widens the interval by it."""
    step = options.fd_step
    steps = (step, FD_STEP_RATIO * step)
    chunk = plan.directions_per_chunk(2 * len(steps) * len(x), options.memory_bytes)
    products = lambda v: _fd_products(f, x, v, steps)  # noqa: E731
    if _fd_uses_basis(options.fd_directions, plan.d):
        both = _basis_sum(products, plan.d, x, chunk, _per_step_squared_norms)
        stderr, method, exact, count = torch.zeros_like(both[:, 0]), "finite-difference", True, plan.d
    else:
        both, stderrs, count = _probe_mean(products, x, options, chunk, _per_step_squared_norms)
        stderr, method, exact = stderrs[:, 0], "finite-difference-hutchinson", False
    return TraceEstimate(
        values=both[:, 0],
        stderr=stderr,
        method=method,
        exact=exact,
        products=2 * len(steps) * count,
        fd_step=step,
        fd_error=(both[:, 1] - both[:, 0]).abs(),
    )


@dataclass(frozen=True)
class StepChoice:
    """Finite-difference steps tried on a pilot (coarse to fine, each FD_STEP_RATIO times the next)
    and the relative change of the pilot's trace from each step to the next. The run uses the
    pair that changed least: truncation error shrinks with the step, rounding error grows."""

    steps: tuple[float, ...]
    changes: tuple[float, ...]

    @property
    def pair(self) -> int:
        return min(range(len(self.changes)), key=self.changes.__getitem__)

    @property
    def step(self) -> float:
        return self.steps[self.pair + 1]

    @property
    def converges(self) -> bool:
        """Whether smaller steps made the estimate settle: the chosen pair's change is at the rounding
        floor or at most FD_CONVERGENCE of the coarsest pair's, and no change on the way there grew
        beyond 1 / FD_CONVERGENCE of the coarsest (a pilot's few directions make them uneven). A jump
        (quantised outputs) or noise inside the model makes the changes grow or stall instead."""
        first, least = self.changes[0], self.changes[self.pair]
        bounded_on_the_way = max(self.changes[: self.pair + 1]) <= max(first / FD_CONVERGENCE, FD_ROUNDING_FLOOR)
        return bounded_on_the_way and (least <= FD_ROUNDING_FLOOR or least <= FD_CONVERGENCE * first)


def choose_fd_step(f: BatchFn, x: Tensor, options: TraceOptions, plan: Plan) -> StepChoice:
    """Central differences on FD_PILOT_SAMPLES samples and FD_PILOT_DIRECTIONS directions of the
    kind the run uses (basis vectors spread over the input, or Rademacher probes) at the steps
    finite_difference_step(x) * FD_STEP_RATIO^-k, k < FD_LADDER_STEPS, all on the same directions."""
    steps = tuple(finite_difference_step(x) * FD_STEP_RATIO**-k for k in range(FD_LADDER_STEPS))
    pilot = x[:FD_PILOT_SAMPLES]
    if _fd_uses_basis(options.fd_directions, plan.d):
        picks = torch.linspace(0, plan.d - 1, min(plan.d, FD_PILOT_DIRECTIONS)).round().long().tolist()
        directions = torch.cat([_basis(i, i + 1, pilot) for i in picks])
    else:
        directions = rademacher((FD_PILOT_DIRECTIONS, *pilot.shape), pilot, options.generator)
    chunk = plan.directions_per_chunk(2 * len(steps) * len(pilot), options.memory_bytes)
    traces = sum(
        _per_step_squared_norms(_fd_products(f, pilot, part, steps)).double().sum((0, 1))
        for part in directions.split(chunk)
    )
    changes = tuple(_relative_change(float(a), float(b)) for a, b in zip(traces[:-1], traces[1:]))
    return StepChoice(steps=steps, changes=changes)


def _relative_change(coarse: float, fine: float) -> float:
    if coarse == fine:
        return 0.0
    return abs(coarse - fine) / fine if fine > 0 else math.inf


def fd_error_bounded(choice: StepChoice | None, relative_error: float) -> bool:
    """Whether the two-step difference is a credible bound on the finite-difference error: the
    pilot converged (or the step was given) and the run's difference is at most FD_MAX_RELATIVE_ERROR."""
    return (choice is None or choice.converges) and relative_error <= FD_MAX_RELATIVE_ERROR


def finite_difference_step(x: Tensor) -> float:
    """h = eps^(1/3) * scale: balances the O(h^2) truncation error of central differences on a
    smooth model against the O(eps/h) rounding error (eps of x's dtype, scale = the data's
    standard deviation); the largest step choose_fd_step tries (kinks want smaller ones)."""
    scale = float(x.std()) if x.numel() > 1 else 0.0
    scale = scale if scale > 0 else max(float(x.abs().max()), 1.0)
    return torch.finfo(x.dtype).eps ** (1 / 3) * scale


def _fd_uses_basis(directions: str, d: int) -> bool:
    if directions not in ("auto", "basis", "random"):
        raise ValueError(f"fd_directions must be auto, basis or random, not {directions!r}")
    return directions == "basis" or (directions == "auto" and d <= FD_BASIS_MAX_DIRECTIONS)


@torch.no_grad()
def _fd_products(f: BatchFn, x: Tensor, directions: Tensor, steps: tuple[float, ...]) -> Tensor:
    """J(x_i) v by central differences at each step, for directions [k, N, *x]: [k, N, steps, m],
    all in one batched call."""
    k, s = len(directions), len(steps)
    h = torch.tensor(steps, dtype=x.dtype, device=x.device).view(s, 1, 1, *[1] * (x.dim() - 1))
    shifted = torch.stack([x + h * directions, x - h * directions])  # [2, s, k, N, *x]
    out = f(shifted.reshape(-1, *x.shape[1:])).reshape(2, s, k, len(x), -1)
    quotients = (out[0] - out[1]) / (2 * h.view(s, 1, 1, 1))
    return quotients.permute(1, 2, 0, 3)


def _per_step_squared_norms(products: Tensor) -> Tensor:
    """[k, N, steps, m] -> [k, N, steps]."""
    return products.pow(2).sum(-1)


# --- shared -----------------------------------------------------------------------------------


def product_fn(f: BatchFn, x: Tensor, side: str) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """(a tensor shaped like the directions, directions [k, N, ...] -> products [k, N, ...]):
    side "inputs": J v (forward mode), side "outputs": J^T u (reverse mode, one forward pass; one
    per product for a stochastic f, so that each product sees its own draw)."""
    if side == "inputs":
        return x, lambda v: _jvp_products(f, x, v)
    out, pullback = vjp(f, x)
    if is_stochastic(f):
        return out.detach(), lambda u: vmap(lambda ui: vjp(f, x)[1](ui)[0], randomness="different")(u).detach()
    return out.detach(), lambda u: vmap(pullback)(u)[0].detach()


def is_stochastic(f: BatchFn) -> bool:
    """Whether f draws random numbers in its forward pass (an Encoder says so; other functions are
    taken as deterministic)."""
    return bool(getattr(f, "stochastic", False))


_model_cache: dict[tuple, tuple[Callable[[], object], object]] = {}


def cached_per_model(kind: str, f: BatchFn, x: Tensor, compute: Callable[[], object]) -> object:
    """compute() once per model f, input shape x.shape[1:] and kind (entries die with f)."""
    key = (kind, id(f), tuple(x.shape[1:]))
    hit = _model_cache.get(key)
    if hit is not None and hit[0]() is f:
        return hit[1]
    value = compute()
    try:
        _model_cache[key] = (weakref.ref(f), value)
        weakref.finalize(f, _model_cache.pop, key, None)
    except TypeError:  # f cannot be weakly referenced: nothing is cached
        pass
    return value


def forward_mode_works(f: BatchFn, x: Tensor) -> bool:
    """Whether every operator of f has a forward-mode derivative (one jvp on one sample, cached
    per model and input shape). PyTorch raises for the few that have none."""

    def probe() -> bool:
        try:
            with torch.no_grad():
                jvp(f, (x[:1],), (torch.zeros_like(x[:1]),))
            return True
        except (RuntimeError, NotImplementedError) as exc:
            if "forward" not in str(exc).lower():
                raise
            return False

    return cached_per_model("forward-mode", f, x, probe)


def _jvp_products(f: BatchFn, x: Tensor, directions: Tensor) -> Tensor:
    """J(x_i) v for directions [k, N, *x]: k forward-mode products, vmapped (each with its own
    draw of a stochastic f's randomness; no effect on a deterministic f)."""
    return vmap(lambda v: jvp(f, (x,), (v,))[1], randomness="different")(directions).detach()


def _squared_norms(products: Tensor) -> Tensor:
    """[k, N, ...] -> [k, N]: squared norm of each product."""
    return products.pow(2).flatten(2).sum(2)
