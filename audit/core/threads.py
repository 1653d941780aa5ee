"""CPU thread policy for the small networks and probes an audit trains."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
from threadpoolctl import threadpool_limits

SMALL_WORK = 1_000_000  # data values (samples x dimensions) below which one CPU thread is fastest


@contextmanager
def threads_for(work_values: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """One thread for torch and for the OpenMP/BLAS pools (scikit-learn) while a CPU job on fewer
    than SMALL_WORK data values runs; restored afterwards. Such ops are too short to share between
    threads, and on two busy cores the threads' hand-offs made them 10-40x slower (measured on
    the digits sample: SSM 250 s -> 13.5 s, fine-tune 140 s -> 7 s). Large jobs keep every thread."""
    if torch.device(device).type != "cpu" or work_values >= SMALL_WORK:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(before)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
