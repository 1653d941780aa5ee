"""Conformance suite of the trace-method registry (core/registries.py: TRACE_METHODS): every
registered method, on a model whose ||J||_F^2 is known in closed form, gives that value, and what
its registry line declares (AD side, cost model) is what it does. A new method is added to the
table and runs here without a new test.

The model is a valid 1-D convolution without bias, C_in = 1, C_out = 2, kernel k over length L:
linear, so J is the same at every x, and each of the L - k + 1 output positions of each output
channel sees the k kernel weights once, so ||J||_F^2 = (L - k + 1) ||W||_F^2. It has local
structure (the structured method applies) and forward mode works (every method applies).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from splitaudit.core import registries
from splitaudit.core.registries import TRACE_METHODS as METHODS
from splitaudit.estimators import structured
from splitaudit.estimators.jacobian import TraceOptions, measure_plan
from splitaudit.estimators.mean_trace import MeanOptions, estimate_mean_trace, planned_products
from splitaudit.estimators.methods import differentiates, exact_costs, jacobian_trace

LENGTH, KERNEL = 32, 3
CHECK_MODE = {"inputs": "reverse", "outputs": "forward", "differences": "finite-difference"}


def _conv() -> tuple[nn.Module, float]:
    torch.manual_seed(0)
    conv = nn.Conv1d(1, 2, KERNEL, bias=False).double()
    return conv, (LENGTH - KERNEL + 1) * float(conv.weight.detach().pow(2).sum())


def _x(n: int = 6) -> torch.Tensor:
    return torch.randn(n, 1, LENGTH, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_gives_the_closed_form_frobenius_norm(name):
    """Exact methods to float64 rounding (finite differences: to their step's error, 0 on a linear
    map up to rounding); random ones: the mean over the samples within 5 of its standard error
    (one sample's standard error, from a few probes, is itself too noisy to test against)."""
    conv, expected = _conv()
    options = TraceOptions(generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # a second call reuses cached colourings and plans: same answer
        estimate = jacobian_trace(conv, _x(), name, options)
        assert estimate.method.startswith(name)
        if estimate.exact:
            torch.testing.assert_close(estimate.values, torch.full_like(estimate.values, expected), rtol=1e-6, atol=0)
        else:
            assert bool((estimate.stderr > 0).all())
            mean, stderr = (
                float(estimate.values.mean()),
                float(estimate.stderr.pow(2).sum().sqrt()) / len(estimate.values),
            )
            assert abs(mean - expected) <= 5 * stderr


@pytest.mark.parametrize("name", list(METHODS))
def test_the_cross_check_takes_the_other_side_than_the_method_declares(name):
    """The registry's side decides the runtime check: a method declaring the wrong side would be
    checked against itself; the check passes on the closed form and its mode is the other side."""
    conv, expected = _conv()
    options = MeanOptions(generator=torch.Generator().manual_seed(3))
    result = estimate_mean_trace(conv, _x(), name, options)
    assert result.check["passed"]
    if name != "hutchinson":  # the probe sampler picks its side on the model; the others declare it
        assert result.check["mode"] == CHECK_MODE[METHODS[name].side]
    assert abs(result.mean - expected) <= 5 * result.stderr + 1e-6 * expected


def test_the_cost_models_count_the_products_the_methods_take(monkeypatch):
    """Each exact method's declared products per sample is what its estimate reports it used, and
    auto picks the fewest (structured: one per colour, the kernel size on this conv). The search for
    structure runs without its budget here (on a conv this small the plain methods cost as little:
    tests/test_structured.py checks the budget)."""
    monkeypatch.setattr(structured, "PROBING_SHARE", math.inf)
    conv, _ = _conv()
    x = _x()
    costs = exact_costs(conv, x, measure_plan(conv, x))
    assert costs == {"forward": LENGTH, "reverse": 2 * (LENGTH - KERNEL + 1), "structured": KERNEL}
    for name, products in costs.items():
        assert jacobian_trace(conv, x, name).products == products
    assert jacobian_trace(conv, x, "auto").method == "structured"
    x100 = torch.randn(100, 1, LENGTH, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    planned = planned_products(conv, x100, "auto", MeanOptions())
    assert (planned.products, planned.pilot_products) == (100 * KERNEL + 4 * 16, 0)  # exact, plus the cross-check


def test_names_and_autograd_needs_come_from_the_table():
    assert [name for name in ("auto", *METHODS) if not differentiates(name)] == ["finite-difference"]
    with pytest.raises(ValueError, match="choose auto, forward, reverse"):
        differentiates("backward")


@pytest.mark.parametrize("name", [name for name in METHODS if name != "structured"])
def test_each_method_takes_the_products_of_the_side_it_declares(name, monkeypatch):
    """The declared side is what the method computes: forward-mode products (J v) for "inputs",
    reverse-mode ones (J^T u) for "outputs", neither for "differences". Structured colours either
    side and declares "inputs" for its check (estimators/structured.py), so it is left out."""
    from splitaudit.estimators import jacobian

    used = {"inputs": 0, "outputs": 0}
    jvp_products, vjp = jacobian._jvp_products, jacobian.vjp

    def counting_jvp(*args):
        used["inputs"] += 1
        return jvp_products(*args)

    def counting_vjp(*args):
        used["outputs"] += 1
        return vjp(*args)

    monkeypatch.setattr(jacobian, "_jvp_products", counting_jvp)
    monkeypatch.setattr(jacobian, "vjp", counting_vjp)
    conv, _ = _conv()
    jacobian_trace(conv, _x(), name, TraceOptions(generator=torch.Generator().manual_seed(4)))
    side = METHODS[name].side
    assert {s for s, calls in used.items() if calls} == ({side} if side in used else set())


def toy_trace(f, x, options, plan):
    """A toy exact method for the registry test: forward mode under another name."""
    from splitaudit.estimators.jacobian import forward_trace

    return dataclasses.replace(forward_trace(f, x, options, plan), method="toy")


def toy_products(f, x, plan):
    """Cheaper than any method on any model, so that "auto" picks it."""
    return 1


def test_a_new_method_is_one_registry_line(monkeypatch):
    """A method added to the registry alone is run by name, picked by "auto" by its cost model,
    cross-checked on the other side than it declares, and listed in the reference."""
    from docs.generate import trace_methods_section

    toy = registries.TraceMethod(
        "toy",
        "inputs",
        "forward mode under another name",
        ("test_trace_methods", "toy_trace"),
        ("test_trace_methods", "toy_products"),
    )
    monkeypatch.setitem(registries.TRACE_METHODS, "toy", toy)
    conv, expected = _conv()
    for method in ("toy", "auto"):
        estimate = jacobian_trace(conv, _x(), method)
        assert estimate.method == "toy"
        torch.testing.assert_close(estimate.values, torch.full_like(estimate.values, expected), rtol=1e-6, atol=0)
    result = estimate_mean_trace(conv, _x(), "toy", MeanOptions(generator=torch.Generator().manual_seed(5)))
    assert result.check["passed"] and result.check["mode"] == "reverse"
    assert differentiates("toy")
    assert "| `toy` | J v (forward mode) | forward mode under another name |" in "\n".join(trace_methods_section())
