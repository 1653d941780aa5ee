"""Every benchmark script still imports and parses its options (`--help`): a rename in the package
must not leave a benchmark broken until someone runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_and_shows_its_help(script):
    if script.name == "executor_overhead.py":
        pytest.importorskip("ray", reason='needs Ray (pip install "splitaudit[ray]")')
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
