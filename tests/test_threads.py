"""The CPU thread policy: one thread for small jobs, every thread for large ones, always restored."""

import torch
from threadpoolctl import threadpool_info

from splitaudit.core.threads import SMALL_WORK, threads_for


def test_small_cpu_work_runs_on_one_thread_and_restores():
    before = torch.get_num_threads()
    with threads_for(SMALL_WORK - 1):
        assert torch.get_num_threads() == 1
        assert all(pool["num_threads"] == 1 for pool in threadpool_info())
    assert torch.get_num_threads() == before


def test_large_or_gpu_work_keeps_every_thread():
    before = torch.get_num_threads()
    with threads_for(SMALL_WORK):
        assert torch.get_num_threads() == before
    with threads_for(10, "cuda"):
        assert torch.get_num_threads() == before
