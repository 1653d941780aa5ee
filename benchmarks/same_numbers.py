"""Compare every number of two report.json (or sweep.json) files, field by field.

A refactoring must leave a seeded audit's numbers unchanged: run `splitaudit demo --quick` (or
`demo --sweep --quick`) before and after, then

    python -m benchmarks.same_numbers before/report.json after/report.json

prints each number that differs (path, before, after), the paths present on one side only, and
exits 1 when anything but wall-clock fields differs. Wall-clock fields (seconds, start time and
worker names) are only counted: they change from run to run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

# Keys whose values are wall-clock times or worker names, not results of the audit.
CLOCK_KEYS = {"seconds", "started", "worker"}


def leaves(value, path: str = "") -> dict[str, object]:
    """Every scalar of a JSON document by its path (a.b[0].c)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{path}.{key}" if path else key).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{path}[{i}]").items()}
    return {path: value}


def is_clock(path: str) -> bool:
    last = path.rsplit(".", 1)[-1].split("[", 1)[0]
    return last in CLOCK_KEYS or last.endswith("_seconds")


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    with open(args.before) as f:
        before = leaves(json.load(f))
    with open(args.after) as f:
        after = leaves(json.load(f))
    changed = [p for p in before if p in after and not same(before[p], after[p])]
    results = [p for p in changed if not is_clock(p)]
    only = sorted(set(before) ^ set(after))
    numbers = sum(isinstance(v, (int, float)) and not isinstance(v, bool) for v in before.values())
    print(f"{len(before)} fields before ({numbers} numbers), {len(after)} after")
    for path in results:
        print(f"DIFFERS {path}: {before[path]!r} -> {after[path]!r}")
    for path in only:
        side = "before" if path in before else "after"
        print(f"ONLY {side} {path}: {(before if side == 'before' else after)[path]!r}")
    print(
        f"{len(results)} result fields differ, {len(only)} on one side only, {len(changed) - len(results)} clock fields"
    )
    return 1 if results or only else 0


if __name__ == "__main__":
    sys.exit(main())
