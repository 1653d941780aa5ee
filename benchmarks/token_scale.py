"""`splitaudit run --quick --attacks all` on a GPT-2-small-sized token bottom, stage by stage.

The scale target (under 15 minutes on 2 CPU cores): a GPT-2-small-sized client side,
embedding 50257 x 768 plus learned positions and 2 pre-norm GELU transformer blocks (12 heads,
MLP 3072), random weights, T = 128, exported with torch.onnx.export (legacy exporter, int64
input_ids), audited with `--vocab` on generated Zipf-distributed token ids. It prints the
measured wall time and peak resident memory of every stage (load, dFIL, prior, each attack).

    python -m benchmarks.token_scale [--samples 64] [--length 128] [--vocab 50257] [--dim 768] [--prior gaussian]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from benchmarks.demo_stages import StageClock, instrument, print_stages, quiet_cli_run


class GPT2Bottom(nn.Module):
    """Token + position embeddings and `blocks` pre-norm transformer blocks (GPT-2's layout)."""

    def __init__(self, vocab: int, dim: int, length: int, blocks: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Parameter(0.01 * torch.randn(length, dim))
        layer = lambda: nn.TransformerEncoderLayer(
            dim, dim // 64, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.ModuleList([layer() for _ in range(blocks)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids) + self.wpe
        for block in self.blocks:
            h = block(h)
        return h


def write_inputs(folder: Path, args) -> tuple[Path, Path, Path]:
    torch.manual_seed(0)
    model = GPT2Bottom(args.vocab, args.dim, args.length).eval()
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, args.vocab + 1) ** 1.1
    x = rng.choice(args.vocab, size=(args.samples, args.length), p=p / p.sum())
    np.savez(folder / "tokens.npz", x=x, y=(x[:, 0] < 10).astype(int), attr=(x[:, -1] % 2).astype(int))
    (folder / "vocab.json").write_text(json.dumps([f"t{i}" for i in range(args.vocab)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.from_numpy(x[:2]),),
            str(folder / "gpt2_bottom.onnx"),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids"],
            dynamic_axes={"input_ids": {0: "batch"}},
        )
    return folder / "gpt2_bottom.onnx", folder / "tokens.npz", folder / "vocab.json"


def audit(args) -> None:
    torch.set_num_threads(args.threads)
    clock, results = StageClock(trace_python=False), []
    instrument(clock, results)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        model, data, vocab = write_inputs(folder, args)
        prep = time.perf_counter() - start
        argv = ["run", str(model), "--aux", str(data), "--vocab", str(vocab), "--quick", "--attacks", "all"]
        argv += ["--prior", args.prior]
        argv += ["--out", str(folder / "report"), "--format", "json", "--workers", "1", "--debug"]
        exit_code, _ = quiet_cli_run(clock, argv)
    print(
        f"splitaudit run --quick --attacks all: GPT-2-sized bottom (embedding {args.vocab} x {args.dim}, 2 blocks), "
        f"T = {args.length}, {args.samples} sentences, legacy ONNX; torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f}, exit code {exit_code}; data + export {prep:.1f} s (not in the audit)"
    )
    print_stages(clock.stages, results[0] if results else {})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    # score matching builds a dense layer on the T x D = 98304 flat inputs and refuses; the Gaussian
    # fit is the prior term's floor (an optimistic bound), so the benchmark measures time, not the bound
    parser.add_argument("--prior", default="gaussian")
    audit(parser.parse_args())
