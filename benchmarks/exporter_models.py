"""Audit exporter-style ONNX models end to end and check their dFIL against the torch module they came from.

    python -m benchmarks.exporter_models build DIR
        writes, for a MobileNetV3-style text-line bottom (3x48x192) and a 1-D conv bottom (4x400),
        the model in Paddle2ONNX style (weights as Constant nodes, batch declared -1 or 0) as
        DIR/NAME.onnx and its data DIR/NAME.npz (text lines rendered with PIL's default font,
        label upright / turned 180 degrees; sequences of two tones, label which is louder)
    splitaudit run DIR/NAME.onnx --aux DIR/NAME.npz --attacks none --noise-sigma 0.1 --smoothing 0 \
        --out DIR/NAME-report --format json
    python -m benchmarks.exporter_models check DIR NAME [--samples 8]
        recomputes ||J||_F^2 exactly (reverse mode, every output, chunked) on the original torch
        module at the first target samples the report computed the dFIL at, and prints the
        report's load mode, parity, and per-sample dFIL next to the exact values.

--smoothing 0 makes the report's dFIL concern the data points themselves (no randomised
smoothing), so the exact values can be computed at the same inputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from splitaudit.inputs.data import load_dataset, split_dataset
from tests.support.exporter_graphs import SEQUENCE, STYLES, TEXT_LINE, seeded
from tests.support.exporter_graphs import write_style as write_graph

MODELS = {"textline": STYLES[0], "sequence": STYLES[1]}
NOISE_SIGMA = 0.1
CHUNK = 256


def text_lines(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n text lines of random words, black on white, 3x48x192 in [0, 1]; half turned 180 degrees."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    font = ImageFont.load_default(size=20)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789"))
    images, labels = [], []
    for i in range(n):
        words = " ".join("".join(rng.choice(letters, rng.integers(2, 7))) for _ in range(3))
        img = Image.new("RGB", (TEXT_LINE[2], TEXT_LINE[1]), (255, 255, 255))
        ImageDraw.Draw(img).text((int(rng.integers(2, 20)), int(rng.integers(6, 18))), words, fill=(0, 0, 0), font=font)
        turned = i % 2
        if turned:
            img = img.rotate(180)
        images.append(np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255)
        labels.append(turned)
    return np.stack(images), np.array(labels)


def two_tones(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n sequences of 4 channels x 400 steps in [0, 1]: two tones plus noise; label: the louder tone."""
    rng = np.random.default_rng(seed)
    t = np.arange(SEQUENCE[1]) / SEQUENCE[1]
    labels = rng.integers(0, 2, n)
    loud = np.where(labels[:, None, None] == 1, [0.6, 0.2], [0.2, 0.6])  # (n, 1, 2)
    phase = rng.uniform(0, 2 * np.pi, (n, SEQUENCE[0], 1))
    tones = loud[..., :1] * np.sin(2 * np.pi * 5 * t + phase) + loud[..., 1:] * np.sin(2 * np.pi * 23 * t + phase)
    x = 0.5 + 0.5 * (tones + 0.1 * rng.standard_normal((n, SEQUENCE[0], SEQUENCE[1])))
    return np.clip(x, 0, 1).astype(np.float32), labels


def build(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, style in MODELS.items():
        path, _ = write_graph(style, folder)
        path.rename(folder / f"{name}.onnx")
        x, y = text_lines(120) if name == "textline" else two_tones(200)
        np.savez(folder / f"{name}.npz", x=x, y=y)
        print(f"wrote {folder / name}.onnx and {folder / name}.npz ({len(x)} samples of {x.shape[1:]})")


def exact_trace(module: torch.nn.Module, x: torch.Tensor) -> float:
    """||J(x)||_F^2 by reverse mode over every output direction, in chunks of CHUNK."""
    z, pullback = torch.func.vjp(lambda v: module(v[None])[0].flatten(), x)
    eye = torch.eye(z.numel())
    total = 0.0
    for chunk in eye.split(CHUNK):
        rows = torch.vmap(pullback)(chunk)[0]
        total += float(rows.detach().double().pow(2).sum())
    return total


def check(folder: Path, name: str, samples: int) -> None:
    report = json.loads((folder / f"{name}-report" / "report.json").read_text())
    module = seeded(MODELS[name].make)
    data = load_dataset(folder / f"{name}.npz")
    _, target = split_dataset(data, 0.5, report["run"]["seed"])
    dfil = report["dfil"]
    index, per_sample = dfil["target_index"][:samples], dfil["per_sample"][:samples]
    stderr = (dfil.get("per_sample_stderr") or [0.0] * samples)[:samples]
    d = target.x[0].numel()
    model = report["model"]
    print(
        f"{name}: gradient_mode {model['gradient_mode']}, parity {model['parity_max_abs_err']}, method {dfil['method']}"
    )
    print(f"report dFIL mean {dfil['mean']:.6g} (stderr {dfil.get('stderr')}) over {len(dfil['per_sample'])} samples")
    exact = []
    for i, reported, se in zip(index, per_sample, stderr):
        value = exact_trace(module, target.x[i]) / (d * NOISE_SIGMA**2)
        exact.append(value)
        print(
            f"  target {i}: report {reported:.6g} +- {se:.2g}, exact {value:.6g}, rel diff {reported / value - 1:+.2e}"
        )
    print(f"mean of these {len(exact)}: report {np.mean(per_sample):.6g}, exact {np.mean(exact):.6g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build").add_argument("folder", type=Path)
    checking = sub.add_parser("check")
    checking.add_argument("folder", type=Path)
    checking.add_argument("name", choices=sorted(MODELS))
    checking.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    build(args.folder) if args.command == "build" else check(args.folder, args.name, args.samples)


if __name__ == "__main__":
    main()
