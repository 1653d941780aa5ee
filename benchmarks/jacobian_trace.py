"""Exact ||J||_F^2 on a CIFAR-shaped CNN encoder: the structured engine against the plain ways.

Encoder: conv(3,16,3,p1)-GELU-conv(16,16,3,p1)-GELU-avgpool2, 3x32x32 -> 16x16x16 = 4096 outputs
(an early split). On one batch it times, side by side in one run:

  (a) naive       one backward pass per output (m passes over the batch)
  (b) forward-100 forward JVPs over all d input coordinates in chunks of 100 (Maeng et al.'s (NeurIPS 2023) code)
  (c) structured  the engine, jacobian_trace(method="auto"), which picks "structured": outputs
                  (one vjp per colour) or inputs (one jvp per colour) coloured, whichever needs
                  fewer products; "cold" includes detecting and checking the colouring, "warm"
                  reuses it (an audit detects once per model and shape)
  (d) bare        the products (c) performs, on precomputed directions: the hardware limit
                  for that number of products

checks that all agree to 1e-4 relative and prints times and ratios.

    python -m benchmarks.jacobian_trace [--batch 8] [--device cpu|cuda|auto] [--threads 2]
                                        [--naive-outputs 512 | 0 for all]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
from torch.func import jvp, vjp, vmap

from splitaudit.estimators import jacobian_trace
from splitaudit.estimators.jacobian import DEFAULT_MEMORY_BYTES, measure_plan, product_fn
from splitaudit.estimators.structured import _chunks, find_colouring

RTOL = 1e-4
FORWARD_CHUNK = 100
NAIVE_OUTPUTS = 512  # (a) costs the same per output, so its time on all m is linear in these


def cifar_encoder(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = (
        nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.GELU(),
            nn.AvgPool2d(2),
        )
        .eval()
        .to(device)
    )
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def naive(f, x: torch.Tensor, outputs: int) -> torch.Tensor:
    """One backward pass per output over the batch (samples are independent), first `outputs` outputs."""
    x = x.detach().requires_grad_()
    out = f(x).flatten(1)
    total = torch.zeros(len(x), device=x.device)
    for j in range(outputs):
        (g,) = torch.autograd.grad(out[:, j].sum(), x, retain_graph=True)
        total += g.pow(2).flatten(1).sum(dim=1)
    return total


def forward_chunks(f, x: torch.Tensor) -> torch.Tensor:
    """Forward mode over every input coordinate, FORWARD_CHUNK basis directions per vmapped jvp."""
    d = x[0].numel()
    total = torch.zeros(len(x), device=x.device)
    for start in range(0, d, FORWARD_CHUNK):
        k = min(FORWARD_CHUNK, d - start)
        basis = torch.zeros(k, d, device=x.device)
        basis[torch.arange(k), torch.arange(start, start + k)] = 1
        directions = basis.view(k, 1, *x.shape[1:]).expand(k, *x.shape)
        _, tangents = vmap(lambda v: jvp(f, (x,), (v,)))(directions)
        total += tangents.pow(2).flatten(2).sum(dim=(0, 2))
    return total


def bare_products(f, x: torch.Tensor, side: str, direction_chunks: list[torch.Tensor]) -> None:
    """The engine's products alone (vmapped vjps or jvps) on ready directions."""
    _, products = product_fn(f, x, side)
    for directions in direction_chunks:
        products(directions)


def warm_up(f, x: torch.Tensor) -> None:
    """First calls import torch.func's machinery, allocate and pick kernels: not what we time."""
    naive(f, x, 2)
    _, pullback = vjp(f, x)
    vmap(pullback)(torch.ones(2, *f(x).shape, device=x.device))
    vmap(lambda v: jvp(f, (x,), (v,)))(torch.ones(2, *x.shape, device=x.device))


def timed(fn, device: torch.device):
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="samples in the batch (default 8)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument(
        "--naive-outputs",
        type=int,
        default=NAIVE_OUTPUTS,
        help="time (a) on the first N outputs only and extrapolate linearly to all m "
        f"(default {NAIVE_OUTPUTS}; 0: all outputs, measured in full)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    f = cifar_encoder(device)
    x = torch.rand(args.batch, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)
    d, m = x[0].numel(), f(x[:1]).numel()
    print(
        f"device {device}, threads {torch.get_num_threads()}, batch {args.batch}, d = {d} inputs, "
        f"m = {m} outputs, load average {os.getloadavg()[0]:.1f}"
    )
    warm_up(f, x)

    cold, t_cold = timed(lambda: jacobian_trace(f, x, "auto"), device)
    warm, t_warm = timed(lambda: jacobian_trace(f, x, "auto"), device)
    assert cold.method == warm.method == "structured", f"auto chose {cold.method}"
    cold, warm = cold.values, warm.values
    plan = measure_plan(f, x)
    colouring = find_colouring(f, x, plan)
    like = x if colouring.side == "inputs" else f(x)
    per_pass = plan.directions_per_chunk(len(x), DEFAULT_MEMORY_BYTES)  # the engine's pass size
    chunks = [
        colouring.masks(c, like)[:, None].expand(-1, *like.shape).contiguous()
        for c in _chunks(torch.arange(colouring.count), per_pass)
    ]
    _, t_bare = timed(lambda: bare_products(f, x, colouring.side, chunks), device)
    reference, t_forward = timed(lambda: forward_chunks(f, x), device)
    outputs = min(args.naive_outputs or m, m)
    partial, t_naive = timed(lambda: naive(f, x, outputs), device)
    t_naive_all = t_naive * m / outputs

    kind = "jvps" if colouring.side == "inputs" else "vjps"
    print(
        f"structured: {colouring.side} coloured with {colouring.count} colours -> {colouring.count} {kind} "
        f"per sample instead of min(d, m) = {min(d, m)} ({min(d, m) / colouring.count:.1f}x fewer products)"
    )
    agree = {"(c) cold": cold, "(c) warm": warm}
    if outputs == m:
        agree["(a) naive"] = partial
    for name, value in agree.items():
        err = float(((value - reference) / reference).abs().max())
        status = "ok" if err <= RTOL else "MISMATCH"
        print(f"  {name} vs (b): max relative difference {err:.1e} ({status}, tolerance {RTOL:g})")
    naive_note = "" if outputs == m else f"  [timed on {outputs} of {m} outputs, extrapolated x{m / outputs:.1f}]"
    rows = [
        ("(a) naive: one backward per output", t_naive_all, naive_note),
        (f"(b) forward JVPs, chunks of {FORWARD_CHUNK}", t_forward, ""),
        ("(c) structured, cold (detect + check + trace)", t_cold, ""),
        ("(c) structured, warm (colouring cached)", t_warm, ""),
        (f"(d) bare {kind}: {colouring.count} x {args.batch} products", t_bare, ""),
    ]
    print(f"\n{'method':48s} {'seconds':>9s} {'s/sample':>9s}")
    for name, seconds, note in rows:
        print(f"{name:48s} {seconds:9.3f} {seconds / args.batch:9.4f}{note}")
    print("\nratios (higher is better for the engine):")
    for label, engine in (("warm", t_warm), ("cold", t_cold)):
        print(
            f"  (a)/(c {label}) = {t_naive_all / engine:6.1f}x   (b)/(c {label}) = {t_forward / engine:6.1f}x"
            f"   (c {label})/(d) = {engine / t_bare:5.2f}x"
        )
    print("targets: (a)/(c) >= 10, (b)/(c) >= 10, (c)/(d) <= 3")


if __name__ == "__main__":
    main()
