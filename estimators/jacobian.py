"""Per-sample squared Frobenius norm of an encoder's Jacobian, ||J_f(x)||_F^2.

This is the hot loop of dFIL (Maeng et al., NeurIPS 2023, Eq. 4-5): for z = f(x) + N(0, sigma^2 I) the Fisher
information is J^T J / sigma^2, so dFIL(x) = ||J(x)||_F^2 / (d sigma^2).

Every method reduces to sums of squared Jacobian products over a set of directions:
- exact forward mode: sum_k ||J e_k||^2 over the d input basis vectors (torch.func.jvp, vmapped);
- exact reverse mode: sum_j ||J^T e_j||^2 over the m output basis vectors (torch.func.vjp, vmapped);
- Hutchinson: E_v ||J v||^2 = ||J||_F^2 for Rademacher v (E[v v^T] = I), with its standard error
  and a stopping rule on the relative standard error;
- finite differences for black-box models: J v ~ (f(x + h v) - f(x - h v)) / 2h over the basis or
  Rademacher probes, through a function that needs no gradients.
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

import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch.func import jvp, vjp, vmap

BatchFn = Callable[[Tensor], Tensor]

DEFAULT_MEMORY_BYTES = 256 * 2**20
FD_BASIS_MAX_DIRECTIONS = 512  # black-box: exact basis up to this many inputs, Hutchinson probes above
MIN_DIRECTIONS_PER_CHUNK = 8


@dataclass(frozen=True)
class TraceOptions:
    """Knobs shared by the methods. rtol/min_probes/max_probes apply to random probes only."""

    memory_bytes: int = DEFAULT_MEMORY_BYTES
    rtol: float = 0.05
    min_probes: int = 8
    max_probes: int = 256
    fd_step: float | None = None  # None: chosen from the data scale (see finite_difference_step)
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
    draws: int = 1  # independent repetitions over a stochastic encoder's draws averaged per sample

    def to(self, device) -> "TraceEstimate":
        return dataclasses.replace(self, values=self.values.to(device), stderr=self.stderr.to(device))


@dataclass(frozen=True)
class Method:
    """A registered trace method.

    compute(f, x, options, plan) -> TraceEstimate. products(f, x, plan) -> products per sample
    when the method is exact and applies to (f, x), else None; "auto" picks the fewest.
    """

    compute: Callable[[BatchFn, Tensor, TraceOptions, "Plan"], TraceEstimate]
    products: Callable[[BatchFn, Tensor, "Plan"], int | None]


@dataclass(frozen=True)
class Plan:
    """Sizes measured once per call: input and output dimensions and memory per product."""

    d: int
    m: int
    bytes_per_product: int

    def directions_per_chunk(self, n_samples: int, budget: int) -> int:
        return max(1, budget // (self.bytes_per_product * max(1, n_samples)))


def jacobian_sq_norm(f: BatchFn, x: Tensor, method: str = "auto", **options) -> Tensor:
    """Per-sample ||J_f(x_i)||_F^2 for a batch function f (exact unless a random method is asked for).

    method: "auto" (the exact method with the fewest products: forward, reverse, or structured
    where the model has local structure; forward mode is skipped for models with an operator that
    has none), "forward", "reverse", "hutchinson" or "finite-difference"; options: fields of
    TraceOptions. Per-sample "auto" stays exact, so its cost grows with min(d, m): for the mean
    over many samples at a given relative error, use estimators.mean_trace.estimate_mean_trace.
    """
    return jacobian_trace(f, x, method, TraceOptions(**options)).values


@torch.no_grad()
def jacobian_trace(
    f: BatchFn, x: Tensor, method: str = "auto", options: TraceOptions = TraceOptions()
) -> TraceEstimate:
    """Like jacobian_sq_norm, with per-sample standard errors and the method actually used.

    Runs under torch.no_grad(): the torch.func transforms still differentiate, but the caller's
    autograd level records nothing, so a module whose parameters require grad does not keep every
    chunk's graph alive (memory stays within options.memory_bytes whatever the caller passes).
    """
    if method != "auto" and method not in METHODS:
        raise ValueError(f"unknown Jacobian method {method!r}; choose auto or {', '.join(METHODS)}")
    plan = measure_plan(f, x, differentiable=method != "finite-difference")
    name = choose_method(f, x, plan) if method == "auto" else method
    samples = max(1, options.memory_bytes // (plan.bytes_per_product * MIN_DIRECTIONS_PER_CHUNK))
    return concatenated([METHODS[name].compute(f, chunk, options, plan) for chunk in x.split(samples)])


def concatenated(parts: list[TraceEstimate]) -> TraceEstimate:
    """One estimate from estimates on consecutive batches of samples (same method)."""
    return TraceEstimate(
        values=torch.cat([p.values for p in parts]),
        stderr=torch.cat([p.stderr for p in parts]),
        method=parts[0].method,
        exact=parts[0].exact,
        products=max(p.products for p in parts),
        fd_step=parts[0].fd_step,
        draws=parts[0].draws,
    )


def choose_method(f: BatchFn, x: Tensor, plan: Plan) -> str:
    """The exact method needing the fewest Jacobian products per sample."""
    costs = exact_costs(f, x, plan)
    return min(costs, key=costs.get)


def exact_costs(f: BatchFn, x: Tensor, plan: Plan) -> dict[str, int]:
    """Products per sample of each exact method that applies to (f, x)."""
    costs = {name: m.products(f, x, plan) for name, m in METHODS.items()}
    return {name: c for name, c in costs.items() if c is not None}


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
    return Plan(d=d, m=m, bytes_per_product=max(floor, two[0] - one[0]))


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


def reverse_trace(f: BatchFn, x: Tensor, options: TraceOptions, plan: Plan) -> TraceEstimate:
    """sum_j ||J^T e_j||^2 over the output basis: m reverse-mode products per sample."""
    out, pullback = vjp(f, x)
    values = _basis_sum(
        lambda u: vmap(pullback)(u)[0], plan.m, out, plan.directions_per_chunk(len(x), options.memory_bytes)
    )
    return _exact(values.detach(), "reverse", plan.m)


def _basis_sum(products: Callable[[Tensor], Tensor], n: int, like: Tensor, chunk: int) -> Tensor:
    """sum over the n basis vectors of the space of like[0] of ||products(e)||^2, per sample."""
    total = torch.zeros(len(like), dtype=like.dtype, device=like.device)
    for start in range(0, n, chunk):
        directions = _basis(start, min(n, start + chunk), like)
        total += _squared_norms(products(directions)).sum(0)
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
    products: Callable[[Tensor], Tensor], x: Tensor, options: TraceOptions, chunk: int
) -> tuple[Tensor, Tensor, int]:
    """Mean and standard error of ||J v||^2 over independent Rademacher probes per sample.

    Probes are added in rounds (min_probes first, then doubling the count, at most `chunk` per
    round); the loop stops once every sample's standard error is at most rtol times its mean,
    or at max_probes.
    """
    total = torch.zeros(len(x), dtype=torch.float64, device=x.device)
    total_sq = torch.zeros_like(total)
    count = 0
    while count < options.max_probes:
        n = min(chunk, max(options.min_probes - count, count, 1), options.max_probes - count)
        probe = rademacher((n, *x.shape), x, options.generator)
        sq = _squared_norms(products(probe)).double()
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
    """Central differences (f(x + h v) - f(x - h v)) / 2h: over the input basis (exact up to
    O(h^2) truncation), or Rademacher probes when d is large. Needs forward passes only."""
    step = options.fd_step or finite_difference_step(x)
    chunk = plan.directions_per_chunk(2 * len(x), options.memory_bytes)
    products = lambda v: _fd_products(f, x, v, step)  # noqa: E731
    if _fd_uses_basis(options.fd_directions, plan.d):
        values = _basis_sum(products, plan.d, x, chunk)
        return TraceEstimate(
            values=values,
            stderr=torch.zeros_like(values),
            method="finite-difference",
            exact=True,
            products=2 * plan.d,
            fd_step=step,
        )
    values, stderr, probes = _probe_mean(products, x, options, chunk)
    return TraceEstimate(
        values=values,
        stderr=stderr,
        method="finite-difference-hutchinson",
        exact=False,
        products=2 * probes,
        fd_step=step,
    )


def finite_difference_step(x: Tensor) -> float:
    """h = eps^(1/3) * scale: balances the O(h^2) truncation error of central differences against
    the O(eps/h) rounding error (eps of x's dtype, scale = the data's standard deviation)."""
    scale = float(x.std()) if x.numel() > 1 else 0.0
    scale = scale if scale > 0 else max(float(x.abs().max()), 1.0)
    return torch.finfo(x.dtype).eps ** (1 / 3) * scale


def _fd_uses_basis(directions: str, d: int) -> bool:
    if directions not in ("auto", "basis", "random"):
        raise ValueError(f"fd_directions must be auto, basis or random, not {directions!r}")
    return directions == "basis" or (directions == "auto" and d <= FD_BASIS_MAX_DIRECTIONS)


@torch.no_grad()
def _fd_products(f: BatchFn, x: Tensor, directions: Tensor, step: float) -> Tensor:
    """J(x_i) v for directions [k, N, *x] by central differences, all in one batched call."""
    k = len(directions)
    shifted = torch.cat([x + step * directions, x - step * directions]).reshape(-1, *x.shape[1:])
    out = f(shifted).reshape(2, k, len(x), -1)
    return (out[0] - out[1]) / (2 * step)


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


# Name -> method. "auto" picks the registered exact method with the fewest products per sample.
# An exact method that exploits model structure (output colouring, estimators/structured.py)
# registers here with its own products(f, x, plan), returning None where it does not apply.
METHODS: dict[str, Method] = {
    "forward": Method(forward_trace, lambda f, x, plan: plan.d if forward_mode_works(f, x) else None),
    "reverse": Method(reverse_trace, lambda f, x, plan: plan.m),
    "hutchinson": Method(hutchinson_trace, lambda f, x, plan: None),
    "finite-difference": Method(finite_difference_trace, lambda f, x, plan: None),
}

from splitaudit.estimators.structured import STRUCTURED  # noqa: E402  (it builds on the names above)

METHODS["structured"] = STRUCTURED
