"""Peak memory of `splitaudit cuts` on a whole ResNet-18 at 224 px, against separate `splitaudit run`s
of the same bottoms: is it bounded by one cut's audit, or does it grow with the cuts audited?

The model is benchmarks/cuts_cost.py's (torchvision's ResNet-18 layout written out, random
convolutions, a head fitted on its features), here at 224 px. `cuts` runs with `--attacks none
--quick` in one process (`--workers 1`: every cut in the parent, the case where the parent's
memory could pile up); then each audited cut's bottom is run alone with its real top at the sigma
`cuts` used. Each command is a child process whose peak resident set size comes from its own
rusage (os.wait4). Also measured: one onnxruntime pass of the whole model over the target images at
once against the batches `cuts` uses now (splitaudit.inputs.onnx_cuts.samples_per_batch).

    python -m benchmarks.cuts_memory                       # 3 cuts, 96 images at 224 px (~15-30 min on 2 cores)
    python -m benchmarks.cuts_memory --cuts 2 --n 48 --size 112
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cuts_cost import make_model_and_data, separate_run_command  # noqa: E402  (the same model, data and runs)

MIB = 1024**2
WHOLE_PASS = """
import sys, numpy as np
from splitaudit.inputs.onnx_cuts import open_whole_model, run_onnx, samples_per_batch
whole = open_whole_model(sys.argv[1], (3, int(sys.argv[2]), int(sys.argv[2])))
x = np.load(sys.argv[3])["x"]
batch = None if sys.argv[4] == "all" else samples_per_batch(whole)
print(min(batch or len(x), len(x)), run_onnx(whole.proto, x, batch=batch).shape)
"""


def peak(command: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(peak RSS in MiB, wall seconds, the finished process) of a child process."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    if done.returncode not in (0, 1):
        sys.exit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start, done  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64, help="base width (64: ResNet-18)")
    parser.add_argument("--size", type=int, default=224, help="image size in pixels")
    parser.add_argument("--n", type=int, default=96, help="images (half aux, half target)")
    parser.add_argument("--cuts", default="3", help="--cuts for splitaudit cuts (a number or names)")
    parser.add_argument("--prior", default="gaussian", choices=("ssm", "dsm", "gaussian"))
    parser.add_argument("--dfil-samples", default="8")
    parser.add_argument("--keep", help="a folder to keep the model, data and reports in")
    args = parser.parse_args()

    folder = Path(args.keep or tempfile.mkdtemp(prefix="cuts-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; files in {folder}")
    model, data = make_model_and_data(folder, args.width, args.n, args.size, seed=0)
    cli = [sys.executable, "-m", "splitaudit"]
    common = ["--aux", str(data), "--quick", "--attacks", "none", "--prior", args.prior]
    common += ["--dfil-samples", args.dfil_samples]
    command = [*cli, "cuts", str(model), *common, "--cuts", args.cuts, "--out", str(folder / "cuts")]
    rss, seconds, done = peak(command)
    print(f"$ splitaudit {' '.join(command[3:])}\n{done.stderr.strip()}\n{done.stdout}")
    print(f"splitaudit cuts: peak RSS {rss:.0f} MiB, {seconds:.0f} s")

    from splitaudit.inputs.onnx_cuts import candidate_cuts, open_whole_model

    document = json.loads((folder / "cuts" / "cuts.json").read_text())
    whole = open_whole_model(model, tuple(document["model"]["input_shape"]))
    points = {c.name: c for c in candidate_cuts(whole)}
    print(f"\n{'cut':40s} {'embedding MiB/sample':>20s} {'separate run peak RSS':>22s}")
    runs = []
    for i, cut in enumerate(document["cuts"]):
        run = separate_run_command(cli, whole, points[cut["name"]], cut["noise_sigma"], common, folder / f"run{i}")
        run_rss, _, _ = peak(run)
        runs.append(run_rss)
        print(f"{cut['name'][:40]:40s} {cut['bytes_sent'] / MIB:20.2f} {run_rss:20.0f} MiB")
    print(f"cuts / largest separate run = {rss / max(runs):.2f}")

    for how in ("all", "batched"):
        rss, seconds, done = peak([sys.executable, "-c", WHOLE_PASS, str(model), str(args.size), str(data), how])
        samples, shape = done.stdout.split(" ", 1)
        print(f"whole model over {args.n} images, {samples} at a time: peak RSS {rss:.0f} MiB ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
