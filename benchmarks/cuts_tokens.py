"""`splitaudit cuts` on a small transformer over tokens: where to split a text classifier.

The whole model: a token embedding (vocabulary 40, width 16) plus a position embedding, three
pre-norm transformer blocks (tests/support/architectures.py's ViTBlock: multi-head attention and a GELU MLP,
each with its residual add), a final LayerNorm, mean pooling over the 12 positions and a linear head.
It is trained for 150 full-batch Adam steps on a synthetic task (the parity of the first token) and
exported by torch's legacy ONNX exporter with a dynamic batch; the data is 400 sequences of ids.

    python -m benchmarks.cuts_tokens                           # 5 cuts, --quick, Gaussian prior (~3 min on 2 cores)
    python -m benchmarks.cuts_tokens --cuts 10 --target-mse 0.05
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

ROOT = Path(__file__).resolve().parents[1]
VOCAB, LENGTH, WIDTH = 40, 12, 16


def make_model_and_data(folder: Path, n: int, seed: int) -> tuple[Path, Path, Path]:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from tests.support.architectures import ViTBlock

    class TokenClassifier(nn.Module):
        def __init__(self, depth: int = 3) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Parameter(0.02 * torch.randn(1, LENGTH, WIDTH))
            self.blocks = nn.Sequential(*[ViTBlock(WIDTH, 2) for _ in range(depth)])
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, 2)

        def forward(self, ids):
            return self.head(self.norm(self.blocks(self.embed(ids) + self.pos)).mean(1))

    torch.manual_seed(seed)
    ids = torch.randint(4, VOCAB, (n, LENGTH))
    y = ids[:, 0] % 2
    model = TokenClassifier()
    optimizer = torch.optim.Adam(model.parameters(), 3e-3)
    for _ in range(150):
        optimizer.zero_grad()
        F.cross_entropy(model.train()(ids), y).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(ids).argmax(1) == y).float().mean())
    print(f"whole model: 3 transformer blocks over {LENGTH} tokens; trained accuracy {accuracy:.3f} on {n} sequences")
    np.savez(folder / "tokens.npz", x=ids.numpy(), y=y.numpy())
    (folder / "vocab.json").write_text(json.dumps([f"t{i}" for i in range(VOCAB)]))
    path = folder / "transformer.onnx"
    axes = {"ids": {0: "batch"}, "logits": {0: "batch"}}
    torch.onnx.export(
        model, (ids[:2],), str(path), dynamo=False, opset_version=17, input_names=["ids"], output_names=["logits"],
        dynamic_axes=axes,
    )  # fmt: skip
    return path, folder / "tokens.npz", folder / "vocab.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuts", default="5")
    parser.add_argument("--prior", default="gaussian", choices=("ssm", "dsm", "gaussian"))
    parser.add_argument("--attacks", default="none")
    parser.add_argument("--target-mse", default="0.03")
    parser.add_argument("--keep", help="a folder to keep the model, data and reports in")
    args = parser.parse_args()
    folder = Path(args.keep or tempfile.mkdtemp(prefix="cuts-tokens-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; files in {folder}")
    model, data, vocab = make_model_and_data(folder, n=400, seed=0)
    command = [sys.executable, "-m", "splitaudit", "cuts", str(model), "--aux", str(data), "--vocab", str(vocab)]
    command += ["--quick", "--prior", args.prior, "--attacks", args.attacks, "--cuts", args.cuts]
    command += ["--target-mse", args.target_mse, "--out", str(folder / "cuts")]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    print(f"$ splitaudit {' '.join(command[3:])}\n{done.stdout}{done.stderr[-2000:] if done.returncode > 1 else ''}")
    print(f"splitaudit cuts: {time.perf_counter() - start:.1f} s, exit {done.returncode}")


if __name__ == "__main__":
    main()
