"""Every benchmark script still imports and parses its options (`python -m benchmarks.NAME --help`
from the repository root, as benchmarks/README.md runs them): a rename in the package or in
tests/support must not leave a benchmark broken until someone runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_and_shows_its_help(script):
    if script.name == "executor_overhead.py":
        pytest.importorskip("ray", reason='needs Ray (pip install "splitaudit[ray]")')
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script.stem}", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
