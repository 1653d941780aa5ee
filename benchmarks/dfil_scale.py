"""dFIL at CIFAR and ImageNet scale: the mean-trace engine's auto against exact forward mode, and
the whole `--attacks none --prior gaussian --noise-sigma 0.1` audit per stage.

Model: ResNet-18 stem + layer1 (conv 7x7/2, BN, ReLU, MaxPool, two basic blocks, width 64) from
tests/support/architectures.py, random weights with trained-like BN statistics, on uniform [0,1] images.
For each size it prints one JSON line:
  auto:  seconds, method, mean ||J||_F^2, its standard error and 95% interval, products used;
  exact: forward mode over all d inputs on the first --exact-samples samples (sizes up to
         --exact-max-size), seconds per sample, its mean on those samples, and auto's estimate on
         the same samples (the ratio of seconds per sample, the relative difference of the means,
         whether the exact mean lies inside auto's interval);
  reverse_check (--reverse-check K): an independent estimate of the same mean from K reverse-mode
         probes per sample on every sample, and whether auto's mean lies in the combined interval;
  audit: seconds of loading (model + data + parity) and of the dFIL/bounds stage of
         `splitaudit run` on a TorchScript trace of the model with --target N samples.
Prints the load average: compare ratios within one run, not seconds across runs.

    python -m benchmarks.dfil_scale [--sizes 32,64,224] [--samples 256] [--exact-samples 8]
                                    [--exact-max-size 64] [--device cpu|cuda|auto] [--threads 2]
                                    [--reverse-check K] [--no-audit]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from splitaudit.core.config import AuditOptions
from splitaudit.estimators import jacobian_sq_norm
from splitaudit.estimators.jacobian import DEFAULT_MEMORY_BYTES, measure_plan
from splitaudit.estimators.mean_trace import MeanOptions, estimate_mean_trace, probe_sums
from splitaudit.inputs.models import resolve_device
from tests.support.architectures import build, export_torchscript


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def auto_row(model, x, device, rtol):
    result, seconds = timed(
        lambda: estimate_mean_trace(
            model, x, "auto", MeanOptions(rtol=rtol, generator=torch.Generator(device=device).manual_seed(0))
        ),
        device,
    )
    low, high = result.interval()
    return result, {
        "seconds": round(seconds, 2),
        "method": result.traces.method,
        "mean": result.mean,
        "stderr": result.stderr,
        "ci95": [low, high],
        "samples": len(result.index),
        "products": result.total_products,
        "check_passed": result.check.get("passed"),
    }


def reverse_row(model, x, device, probes: int, auto_result) -> dict:
    """An independent estimate of the same mean: `probes` reverse-mode Rademacher products
    ||J^T u||^2 per sample on every sample (another AD mode and another seed than auto's), its
    95% interval, and how far auto's mean lies from it: a check of auto where exact traces are
    out of reach (3x224x224: 150,528 forward or 200,704 reverse products per sample)."""
    plan = measure_plan(model, x[:2])
    generator = torch.Generator(device=device).manual_seed(12345)

    def run():
        sums = [
            probe_sums(model, chunk, "outputs", probes, plan, DEFAULT_MEMORY_BYTES, generator) for chunk in x.split(16)
        ]
        return torch.cat(sums, dim=1)

    with torch.no_grad():
        sums, seconds = timed(run, device)
    per_sample = sums[1] / sums[0]
    mean, stderr = float(per_sample.mean()), float(per_sample.std()) / len(per_sample) ** 0.5
    combined = (stderr**2 + auto_result.stderr**2) ** 0.5
    return {
        "seconds": round(seconds, 2),
        "probes_per_sample": probes,
        "mean": mean,
        "ci95": [mean - 1.96 * stderr, mean + 1.96 * stderr],
        "auto_relative_difference": (auto_result.mean - mean) / mean,
        "within_combined_95": abs(auto_result.mean - mean) <= 1.96 * combined,
    }


def exact_row(model, x, device, rtol):
    exact, seconds = timed(lambda: jacobian_sq_norm(model, x, method="forward"), device)
    mean = float(exact.double().mean())
    auto, auto_seconds = timed(
        lambda: estimate_mean_trace(
            model, x, "hutchinson", MeanOptions(rtol=rtol, generator=torch.Generator(device=device).manual_seed(1))
        ),
        device,
    )
    low, high = auto.interval()
    return {
        "samples": len(x),
        "exact_seconds_per_sample": seconds / len(x),
        "exact_mean": mean,
        "auto_seconds_per_sample": auto_seconds / len(x),
        "auto_mean": auto.mean,
        "speedup": (seconds / len(x)) / (auto_seconds / len(x)),
        "relative_difference": (auto.mean - mean) / mean,
        "inside_interval": low <= mean <= high,
    }


def audit_row(model, x, size, device_name, samples):
    from splitaudit.engine.pipeline import prepare_context
    from splitaudit.stages import leakage

    folder = Path(tempfile.mkdtemp())
    export_torchscript(model.cpu(), x[:2].cpu(), folder / "bottom.pt")
    images = x.cpu().numpy().astype(np.float32)
    np.savez(folder / "aux.npz", x=images, y=np.zeros(len(images), dtype=np.int64))
    options = AuditOptions(
        model=str(folder / "bottom.pt"),
        aux=str(folder / "aux.npz"),
        attacks=["none"],
        prior="gaussian",
        noise_sigma=0.1,
        device=device_name,
        target_fraction=0.5,
        input_shape=[3, size, size],
    ).validate()
    ctx, load_seconds = timed(lambda: prepare_context(options), torch.device("cpu"))
    section, dfil_seconds = timed(lambda: leakage.assess(ctx, prior="gaussian"), ctx.device)
    return {
        "target_samples": len(ctx.target),
        "load_seconds": round(load_seconds, 2),
        "dfil_and_bounds_seconds": round(dfil_seconds, 2),
        "method": section["dfil"]["method"],
        "mean_dfil": section["dfil"]["mean"],
        "mean_ci": section["dfil"]["mean_ci"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,64,224")
    parser.add_argument("--samples", type=int, default=256, help="samples for auto (the audit gets 2x as aux)")
    parser.add_argument("--exact-samples", type=int, default=8)
    parser.add_argument("--exact-max-size", type=int, default=64)
    parser.add_argument("--rtol", type=float, default=0.02)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-audit", action="store_true")
    parser.add_argument(
        "--reverse-check", type=int, default=0, metavar="K", help="also K reverse-mode probes per sample (0: no)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    print(json.dumps({"device": str(device), "threads": args.threads, "loadavg": os.getloadavg()}), flush=True)
    for size in (int(s) for s in args.sizes.split(",")):
        model = build("resnet", width=64, blocks=2).to(device)
        x = torch.rand(args.samples, 3, size, size, generator=torch.Generator().manual_seed(size)).to(device)
        result, row = auto_row(model, x, device, args.rtol)
        out = {"size": size, "auto": row}
        if args.reverse_check:
            out["reverse_check"] = reverse_row(model, x, device, args.reverse_check, result)
        if size <= args.exact_max_size:
            out["exact_vs_auto"] = exact_row(model, x[: args.exact_samples], device, args.rtol)
        if not args.no_audit:
            out["audit"] = audit_row(model, torch.cat([x, x.flip(-1)]), size, args.device, args.samples)
        out["loadavg"] = os.getloadavg()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
