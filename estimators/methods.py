"""The entry points that run a Jacobian-trace method by name or pick one: `jacobian_sq_norm` and
`jacobian_trace` (method "auto": the exact method with the fewest products for this model).

The methods are registered in core/registries.py (TRACE_METHODS: name, AD side, words, computation
and cost model); their code is in estimators/jacobian.py (forward, reverse, Hutchinson, finite
differences) and estimators/structured.py (output colouring). This dispatcher imports both, so
neither imports the other's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from splitaudit.core.registries import TRACE_METHODS, TraceMethod, resolve
from splitaudit.estimators.jacobian import (
    MIN_DIRECTIONS_PER_CHUNK,
    BatchFn,
    Plan,
    TraceEstimate,
    TraceOptions,
    choose_fd_step,
    concatenated,
    is_stochastic,
    measure_plan,
)
from splitaudit.estimators.structured import search_structure

DEFAULT_OPTIONS = TraceOptions()


def method_named(name: str) -> TraceMethod:
    """The registered method `name`; ValueError naming the choices for any other name."""
    if name not in TRACE_METHODS:
        raise ValueError(f"unknown Jacobian method {name!r}; choose {', '.join(('auto', *TRACE_METHODS))}")
    return TRACE_METHODS[name]


def differentiates(method: str) -> bool:
    """Whether `method` ("auto" included: it picks among the exact AD methods) needs autograd."""
    return method == "auto" or method_named(method).differentiates


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
    f: BatchFn, x: Tensor, method: str = "auto", options: TraceOptions = DEFAULT_OPTIONS
) -> TraceEstimate:
    """Like jacobian_sq_norm, with per-sample standard errors and the method actually used.

    Runs under torch.no_grad(): the torch.func transforms still differentiate, but the caller's
    autograd level records nothing, so a module whose parameters require grad does not keep every
    chunk's graph alive (memory stays within options.memory_bytes whatever the caller passes).
    """
    plan = measure_plan(f, x, differentiable=differentiates(method))
    name = choose_method(f, x, plan) if method == "auto" else method
    choice = None
    if name == "finite-difference" and options.fd_step is None:  # one step for every chunk of samples
        choice = choose_fd_step(f, x, options, plan)
        options = dataclasses.replace(options, fd_step=choice.step)
    samples = max(1, options.memory_bytes // (plan.bytes_per_product * MIN_DIRECTIONS_PER_CHUNK))
    compute = resolve(method_named(name).compute)
    traces = concatenated([compute(f, chunk, options, plan) for chunk in x.split(samples)])
    return dataclasses.replace(traces, fd_choice=choice) if choice is not None else traces


def choose_method(f: BatchFn, x: Tensor, plan: Plan) -> str:
    """The exact method needing the fewest Jacobian products per sample."""
    return cheapest_exact(f, x, plan)[0]


def cheapest_exact(f: BatchFn, x: Tensor, plan: Plan) -> tuple[str, int]:
    """(name, products per sample) of the exact method needing the fewest products on (f, x)."""
    costs = exact_costs(f, x, plan)
    name = min(costs, key=costs.get)
    return name, costs[name]


def exact_costs(f: BatchFn, x: Tensor, plan: Plan) -> dict[str, int]:
    """Products per sample of each exact method that applies to (f, x)."""
    costs = {name: resolve(m.products)(f, x, plan) for name, m in TRACE_METHODS.items()}
    return {name: c for name, c in costs.items() if c is not None}


PER_PRODUCT = {"forward": "one per input", "reverse": "one per output"}


def exact_choice(f: BatchFn, x: Tensor, plan: Plan, name: str) -> str:
    """Why the exact method `name` is the cheapest on (f, x), for the report: its products per sample,
    the plain methods', and what the search for local structure found (not its CPU time, which
    would make two runs' reports differ: structured.Search keeps it)."""
    costs = exact_costs(f, x, plan)  # cached: the search ran when the method was chosen
    if name == "structured":
        plain = min((c, n) for n, c in costs.items() if n != "structured")
        text = (
            f"the structured method (exact): {costs[name]} products per sample against {plain[0]} for {plain[1]} mode"
        )
    else:
        text = f"{name} mode (exact): {costs[name]} products per sample ({PER_PRODUCT[name]})"
    if is_stochastic(f):
        return text + "; no structured method: the encoder draws random numbers"
    found = "" if name == "structured" else "no structured method: "
    return f"{text}; {found}{search_structure(f, x, plan).reason}"
