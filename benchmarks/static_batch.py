"""dFIL of an OCR-style ONNX model saved with a static batch, batched against one sample per call, and
the exact-method planner's share of it.

Model: an OCR model's first blocks (conv 3x3, BatchNorm, ReLU, max pooling, twice; 16 then 32
channels) on captcha text lines of the ddddocr OCR model's input shape [1, 1, 64, W], exported by
torch's legacy ONNX exporter with the batch fixed at 1, as exporters write it unless told
otherwise. splitaudit frees the batch (it runs whole batches once real data shows the outputs do not
depend on it); the same encoder with fixed_batch=1 is how it ran before: one sample per call.

For each variant, measured side by side in one run (alternating, --repeats times), it prints one
JSON line: dFIL's process CPU seconds and wall seconds (estimate_mean_trace, method auto, on
--samples lines: the search for local structure included, since each variant is a fresh model to the
planner), the method, the mean ||J||_F^2, and the planner's share (the structure search's CPU seconds
over dFIL's). Then the ratios. Prints the load average: compare ratios within one run.

    python -m benchmarks.static_batch [--width 64] [--samples 16] [--repeats 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.estimators.jacobian import measure_plan
from splitaudit.estimators.mean_trace import estimate_mean_trace
from splitaudit.estimators.structured import search_structure
from splitaudit.inputs.models import open_model, prepare_encoder
from tests.support.architectures import export_onnx


def line_stem() -> nn.Module:
    """Two conv blocks of an OCR model, seeded, with trained-like BatchNorm statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
    )  # fmt: skip
    with torch.no_grad():
        for norm in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            norm.running_mean.uniform_(-0.1, 0.1)
            norm.running_var.uniform_(0.5, 1.5)
    return model.eval()


def measured(encoder, x: torch.Tensor) -> dict:
    """dFIL's traces on x with their CPU and wall seconds, and the structure search's share."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = estimate_mean_trace(encoder, x)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    search = search_structure(encoder, x, measure_plan(encoder, x))  # cached: the search dFIL ran
    return {
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "method": result.traces.method,
        "mean_trace": result.mean,
        "search_cpu_s": round(search.seconds, 2),
        "planner_share": round(search.seconds / cpu, 3),
        "choice": result.choice,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = (1, 64, args.width)
    with tempfile.TemporaryDirectory() as folder:
        path = export_onnx(
            line_stem(), torch.rand(1, *shape), Path(folder) / "line.onnx", "legacy", 17, fixed_batch=True
        )
        x = torch.rand(args.samples, *shape, generator=torch.Generator().manual_seed(0))
        batched = prepare_encoder(open_model(path, torch.device("cpu")), x)
    assert batched.fixed_batch is None, "the static batch was not freed"
    print(json.dumps({"input": [1, *shape], "samples": args.samples, "load_average": os.getloadavg()}))
    rows: dict[str, list[dict]] = {"batched": [], "one-by-one": []}
    for _ in range(args.repeats):
        for name in rows:  # a fresh Encoder per run: the planner's cache is per model object
            encoder = dataclasses.replace(batched, fixed_batch=None if name == "batched" else 1)
            rows[name].append(measured(encoder, x))
            print(json.dumps({"variant": name, **rows[name][-1]}))
    best = {name: min(r["cpu_s"] for r in runs) for name, runs in rows.items()}
    same = rows["batched"][0]["mean_trace"] / rows["one-by-one"][0]["mean_trace"] - 1
    print(
        json.dumps(
            {
                "one_by_one_over_batched_cpu": round(best["one-by-one"] / best["batched"], 1),
                "mean_trace_relative_difference": same,
                "planner_share_batched": rows["batched"][0]["planner_share"],
                "load_average": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
