"""Black-box dFIL on a model with kinks: the old single finite-difference step against the step
chosen on a pilot with its two-step error, both against autograd on the same module and samples.

Model: the MobileNetV3-style KinkedBlock of tests/test_finite_difference.py (1x1 expand with a high
gain and staggered biases -> HardSigmoid, depthwise 3x3 -> ReLU, 1x1 project -> Clip(0, 6)), on
uniform [0,1] images. Inputs 3x4x12 (d = 144) use the input basis, 3x8x24 (d = 576) Rademacher
probes. For each shape and gain it prints one JSON line:
  autograd: exact forward-mode mean ||J||_F^2 over the samples and its 95% interval (sample spread);
  old: central differences at eps^(1/3) * std(x) (the step used before), mean and 95% interval as
       the old code reported it (no finite-difference error);
  new: estimate_mean_trace(..., "finite-difference"): chosen step, mean, fd_error, 95% interval
       widened by it, approximate, the black-box cross-check;
  and whether each interval contains the autograd mean; new's seconds (pilot, two steps and the
  cross-check). Prints the load average: seconds depend on what else runs.

    python -m benchmarks.fd_kinks [--samples 64] [--gains 1000,3000,10000] [--shapes 3x4x12,3x8x24]
                                  [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from splitaudit.estimators.jacobian import (
    TraceOptions,
    finite_difference_step,
)
from splitaudit.estimators.mean_trace import Z_95, MeanOptions, estimate_mean_trace
from splitaudit.estimators.methods import jacobian_sq_norm, jacobian_trace
from tests.test_finite_difference import KinkedBlock, black_box


def interval(values: torch.Tensor) -> tuple[float, float, float]:
    """Mean and 95% interval from the spread over samples (what the old black-box path reported)."""
    v = values.double()
    mean, se = float(v.mean()), float(v.std()) / math.sqrt(len(v))
    return mean, mean - Z_95 * se, mean + Z_95 * se


def one(shape: tuple[int, ...], gain: float, samples: int) -> dict:
    net = KinkedBlock(gain).eval()
    x = torch.rand(samples, *shape, generator=torch.Generator().manual_seed(0))
    truth, t_low, t_high = interval(jacobian_sq_norm(net, x, method="forward"))
    step = finite_difference_step(x)
    old = jacobian_trace(black_box(net), x, "finite-difference", TraceOptions(fd_step=step))
    old_mean, old_low, old_high = interval(old.values)
    start = time.perf_counter()
    new = estimate_mean_trace(black_box(net), x, "finite-difference", MeanOptions(generator=torch.Generator()))
    new_seconds = time.perf_counter() - start
    low, high = new.interval()
    return {
        "shape": "x".join(map(str, shape)),
        "gain": gain,
        "samples": samples,
        "autograd": {"mean": truth, "ci": [t_low, t_high]},
        "old": {
            "step": step,
            "mean": old_mean,
            "ci": [old_low, old_high],
            "relative_bias": old_mean / truth - 1,
            "contains_autograd": old_low <= truth <= old_high,
        },
        "new": {
            "step": new.traces.fd_step,
            "mean": new.mean,
            "fd_error": new.fd_error,
            "ci": [low, high],
            "relative_bias": new.mean / truth - 1,
            "contains_autograd": low <= truth <= high,
            "approximate": new.approximate,
            "pilot_changes": [round(c, 5) for c in new.fd_choice.changes],
            "check_passed": new.check.get("passed"),
            "seconds": new_seconds,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--gains", default="1000,3000,10000")
    parser.add_argument("--shapes", default="3x4x12,3x8x24")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps({"load_average": os.getloadavg()}))
    for shape in args.shapes.split(","):
        for gain in args.gains.split(","):
            print(json.dumps(one(tuple(int(s) for s in shape.split("x")), float(gain), args.samples)), flush=True)


if __name__ == "__main__":
    main()
