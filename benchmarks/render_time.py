"""Time `splitaudit render REPORT` in a fresh interpreter, and say whether it imported torch.

Re-rendering a saved report.json reads the result only, so it should cost the import of the
reports and nothing of the computation. With --baseline-tree DIR (a folder holding a `splitaudit`
package laid out as installed, e.g. another checkout's audit/ with attacks/, estimators/,
reports/ and sample_models/ copied into it) the two are timed side by side, interleaved:

    python -m benchmarks.render_time splitaudit-report/report.json --baseline-tree /tmp/main-src
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import sys, time
if sys.argv[1] != "-":  # import the baseline tree instead of this installation
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, sys.argv[1])
start = time.perf_counter()
import splitaudit
from splitaudit import cli
try:
    cli.main(["render", sys.argv[2], "--out", sys.argv[3], "--format", "html,md"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
print(splitaudit.__file__, "torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


def timed_render(tree: str, report: str) -> tuple[float, str]:
    """Wall seconds of one render in a new interpreter, and what it says it imported."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, tree, report, tempfile.mkdtemp()], capture_output=True, text=True, cwd="/"
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return time.perf_counter() - start, done.stderr.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("--baseline-tree", help="a folder holding another splitaudit package to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    trees = {"this": "-", **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    walls: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            wall, said = timed_render(tree, args.report)
            walls[name].append(wall)
            print(f"{name:9s} {wall:6.2f} s  {said}")
    for name, values in walls.items():
        print(f"{name:9s} median {sorted(values)[len(values) // 2]:.2f} s over {len(values)} runs")


if __name__ == "__main__":
    main()
