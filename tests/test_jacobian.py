"""Jacobian traces ||J_f(x)||_F^2: exact methods against closed forms, Hutchinson against its own
standard error, finite differences and both model formats against autograd."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_context

from splitaudit.estimators import TraceOptions, jacobian_sq_norm, jacobian_trace

EXACT = ["auto", "forward", "reverse", "finite-difference"]


def linear_map(m: int, d: int, spectrum: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A = U diag(spectrum) V^T with random orthogonal U (m x m) and V (d x d), float64."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    s = torch.zeros(m, d, dtype=torch.float64)
    s[range(len(spectrum)), range(len(spectrum))] = spectrum
    return u @ s @ v.T


def linear_encoder(a: torch.Tensor, input_shape: tuple[int, ...]):
    """z = A x on inputs of any shape (flattened), a batch function."""
    return lambda x: x.reshape(len(x), -1) @ a.T


@pytest.mark.parametrize("m,d", [(20, 12), (6, 12)])  # more outputs than inputs, and fewer
@pytest.mark.parametrize("method", EXACT)
def test_exact_methods_give_the_frobenius_norm_of_a_linear_map(method, m, d):
    spectrum = torch.logspace(1, -2, min(m, d), dtype=torch.float64)  # condition number 1000
    a = linear_map(m, d, spectrum)
    x = torch.randn(15, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    values = jacobian_sq_norm(linear_encoder(a, (3, 4)), x, method=method)
    expected = float(spectrum.pow(2).sum())
    assert values.shape == (15,)
    assert torch.allclose(values, torch.full_like(values, expected), rtol=1e-9, atol=0)


def test_auto_picks_the_side_with_fewer_products():
    x = torch.randn(4, 12, dtype=torch.float64)
    wide = jacobian_trace(linear_encoder(linear_map(20, 12, torch.ones(12, dtype=torch.float64)), (12,)), x)
    narrow = jacobian_trace(linear_encoder(linear_map(6, 12, torch.ones(6, dtype=torch.float64)), (12,)), x)
    assert (wide.method, wide.products) == ("forward", 12)
    assert (narrow.method, narrow.products) == ("reverse", 6)


def test_float32_exact_methods_agree_to_float_precision():
    a = linear_map(30, 16, torch.linspace(3, 0.1, 16, dtype=torch.float64)).float()
    x = torch.randn(10, 16)
    expected = float(a.double().pow(2).sum())
    for method in ("forward", "reverse"):
        assert torch.allclose(
            jacobian_sq_norm(linear_encoder(a, (16,)), x, method=method).double(),
            torch.full((10,), expected, dtype=torch.float64),
            rtol=1e-5,
        )


def rademacher_variance(a: torch.Tensor) -> float:
    """Var ||A v||^2 for Rademacher v: 2 (||A^T A||_F^2 - sum_i (A^T A)_ii^2)."""
    gram = a.T @ a
    return float(2 * (gram.pow(2).sum() - gram.diagonal().pow(2).sum()))


def test_hutchinson_is_within_three_standard_errors_and_its_error_is_honest():
    a = linear_map(24, 16, torch.linspace(2, 0.2, 16, dtype=torch.float64), seed=3)
    x = torch.randn(64, 16, dtype=torch.float64)
    options = TraceOptions(generator=torch.Generator().manual_seed(5), rtol=0.0, min_probes=32, max_probes=32)
    est = jacobian_trace(linear_encoder(a, (16,)), x, "hutchinson", options)
    truth = float(a.pow(2).sum())
    mean_error = float(est.values.mean()) - truth
    mean_stderr = float(est.stderr.pow(2).sum().sqrt()) / len(x)
    assert (est.method, est.exact, est.products) == ("hutchinson", False, 32)
    assert abs(mean_error) <= 3 * mean_stderr
    # the reported per-sample standard error matches the closed-form Rademacher variance
    expected_stderr = (rademacher_variance(a) / 32) ** 0.5
    assert float(est.stderr.mean()) == pytest.approx(expected_stderr, rel=0.2)


def test_hutchinson_stops_once_the_relative_error_is_reached():
    a = linear_map(24, 16, torch.linspace(2, 0.2, 16, dtype=torch.float64), seed=3)
    x = torch.randn(8, 16, dtype=torch.float64)
    f = linear_encoder(a, (16,))
    loose = jacobian_trace(
        f,
        x,
        "hutchinson",
        TraceOptions(rtol=0.1, max_probes=4096, memory_bytes=1, generator=torch.Generator().manual_seed(0)),
    )
    assert loose.products < 4096
    assert bool((loose.stderr <= 0.1 * loose.values).all())
    strict = jacobian_trace(
        f, x, "hutchinson", TraceOptions(rtol=1e-6, max_probes=40, generator=torch.Generator().manual_seed(0))
    )
    assert strict.products == 40


def test_hutchinson_is_exact_when_the_gram_matrix_is_diagonal():
    """||A v||^2 = sum_i (A^T A)_ii v_i^2 is constant for +-1 entries: zero variance, min probes."""
    a = torch.diag(torch.tensor([3.0, 1.0, 0.5, 2.0], dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64)
    est = jacobian_trace(linear_encoder(a, (4,)), x, "hutchinson", TraceOptions(min_probes=8))
    assert est.products == 8
    assert torch.allclose(est.values, torch.full((5,), 14.25, dtype=torch.float64), rtol=1e-12)
    assert float(est.stderr.max()) == pytest.approx(0.0, abs=1e-10)


def tanh_encoder(seed: int = 0):
    """A smooth nonlinear encoder on 2x3x3 inputs with 7 outputs."""
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = (
        torch.randn(18, 11, generator=gen, dtype=torch.float64),
        torch.randn(11, 7, generator=gen, dtype=torch.float64),
    )
    return lambda x: torch.tanh(torch.tanh(x.reshape(len(x), -1) @ w1) @ w2)


def test_methods_agree_on_a_nonlinear_encoder_and_under_a_tiny_memory_budget():
    f = tanh_encoder()
    x = torch.randn(9, 2, 3, 3, dtype=torch.float64) * 0.3
    jac = torch.func.vmap(torch.func.jacrev(lambda s: f(s[None])[0]))(x)  # [N, 7, 2, 3, 3]
    expected = jac.pow(2).flatten(1).sum(1)
    for method in ("forward", "reverse"):
        assert torch.allclose(jacobian_sq_norm(f, x, method=method), expected, rtol=1e-12)
        assert torch.allclose(jacobian_sq_norm(f, x, method=method, memory_bytes=1), expected, rtol=1e-12)
    assert torch.allclose(jacobian_sq_norm(f, x, method="finite-difference"), expected, rtol=1e-7)


def test_finite_differences_with_random_probes_follow_hutchinson():
    a = linear_map(24, 16, torch.linspace(2, 0.2, 16, dtype=torch.float64), seed=3)
    x = torch.randn(64, 16, dtype=torch.float64)
    options = TraceOptions(
        fd_directions="random", rtol=0.0, min_probes=32, max_probes=32, generator=torch.Generator().manual_seed(2)
    )
    est = jacobian_trace(linear_encoder(a, (16,)), x, "finite-difference", options)
    assert est.method == "finite-difference-hutchinson" and not est.exact
    mean_stderr = float(est.stderr.pow(2).sum().sqrt()) / len(x)
    assert abs(float(est.values.mean()) - float(a.pow(2).sum())) <= 3 * mean_stderr


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="unknown Jacobian method"):
        jacobian_sq_norm(lambda x: x, torch.zeros(2, 3), method="magic")


# --- sample models ------------------------------------------------------------------------------


@pytest.mark.parametrize("stem,data", [("digits_cnn", "digits.npz"), ("breast_cancer_mlp", "breast_cancer.npz")])
def test_torchscript_and_onnx_give_the_same_trace(stem, data):
    onnx_ctx, ts_ctx = make_context(f"{stem}.onnx", data), make_context(f"{stem}.pt", data)
    x = onnx_ctx.target.x[:64]
    assert torch.equal(x, ts_ctx.target.x[:64])
    from_onnx = jacobian_sq_norm(onnx_ctx.encoder, x)
    from_torchscript = jacobian_sq_norm(ts_ctx.encoder, x)
    assert torch.allclose(from_onnx, from_torchscript, rtol=1e-2)
    assert float(from_onnx.mean()) == pytest.approx(float(from_torchscript.mean()), rel=1e-2)


def test_black_box_finite_differences_match_autograd_on_a_sample_model(digits_ctx):
    """onnxruntime (no gradients) through central differences vs autograd on the converted model."""
    x = digits_ctx.target.x[:48]
    autograd = jacobian_sq_norm(digits_ctx.encoder, x, method="forward")
    blackbox = jacobian_trace(digits_ctx.encoder.blackbox_fn, x, "finite-difference")
    assert blackbox.method == "finite-difference" and blackbox.fd_step > 0
    assert torch.allclose(blackbox.values, autograd, rtol=2e-3)


def test_black_box_encoder_uses_finite_differences_in_the_audit(digits_ctx):
    from splitaudit.stages import leakage

    blackbox = dataclasses.replace(digits_ctx, encoder=dataclasses.replace(digits_ctx.encoder, torch_fn=None))
    white = leakage.measure(digits_ctx, prior="gaussian", smoothing=0.0)
    black = leakage.measure(blackbox, prior="gaussian", smoothing=0.0)
    assert black.traces.method == "finite-difference"
    assert black.trace_over_d == pytest.approx(white.trace_over_d, rel=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["forward", "reverse", "finite-difference", "hutchinson"])
def test_methods_run_on_cuda(method):
    a = linear_map(20, 12, torch.linspace(3, 0.1, 12, dtype=torch.float64)).cuda()
    x = torch.randn(16, 12, dtype=torch.float64, device="cuda")
    options = TraceOptions(rtol=0.0, max_probes=64, generator=torch.Generator(device="cuda").manual_seed(0))
    est = jacobian_trace(linear_encoder(a, (12,)), x, method, options)
    assert est.values.device.type == "cuda"
    truth = float(a.pow(2).sum())
    tolerance = 4 * float(est.stderr.max()) if not est.exact else 1e-9 * truth
    assert float((est.values - truth).abs().max()) <= tolerance
