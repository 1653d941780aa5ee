"""A split LLM as users have it: a GPT-2-small-sized Hugging Face checkpoint audited from a text file.

The checkpoint: GPT-2 small's shape (vocabulary 50,257, width 768, 12 heads, 12 blocks, 1,024
positions) with seeded random weights, saved with save_pretrained (safetensors) beside a byte-level
BPE tokenizer trained on the corpus (GPT-2's own tokenizer files cannot be downloaded here; the
embedding table keeps all 50,257 rows, so the inversions search the whole vocabulary). The client
keeps the embedding and the first 2 blocks (--split-layer 2). The data: the corpus cut into texts of
about 140 words, one a line in a .jsonl whose label is the source file, tokenised to 128 tokens.

`splitaudit sweep` runs `--attacks all` at each sigma through the CLI, as a user would; this prints
each text attack's token accuracy, exact match and ROUGE-L per sigma, the sequential inversion's
seconds per sentence and how its prefix states were computed, and the sweep's wall time. With
`--per-sigma` it runs one `splitaudit run` per sigma instead, each bounded by `--run-timeout`, so a
machine lent for a fixed time still returns the reports of the sigmas that finished.

    python -m benchmarks.hf_text_audit --corpus a.txt b.txt --device cuda          # sigmas 0, 1, 4
    python -m benchmarks.hf_text_audit --corpus a.txt --device cuda --per-sigma --run-timeout 200
    python -m benchmarks.hf_text_audit --width 64 --heads 2 --vocab-size 2000 --quick   # a CPU-sized rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS_PER_TEXT = 140
ATTRIBUTE = "mentions_privacy"


def build_checkpoint(folder: Path, corpus: list[Path], args) -> None:
    """A seeded random GPT-2 of the asked shape and a byte-level BPE tokenizer trained on `corpus`."""
    import torch
    from tokenizers import ByteLevelBPETokenizer

    from splitaudit.inputs.optional_imports import import_transformers

    transformers = import_transformers()
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train([str(p) for p in corpus], vocab_size=args.vocab_size, min_frequency=2, show_progress=False)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer._tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    torch.manual_seed(args.seed)
    config = transformers.GPT2Config(
        vocab_size=args.vocab_size, n_embd=args.width, n_head=args.heads, n_layer=args.layers, n_positions=1024
    )
    transformers.GPT2Model(config).eval().save_pretrained(str(folder), safe_serialization=True)
    wrapped.save_pretrained(str(folder))


def write_texts(path: Path, corpus: list[Path], limit: int) -> int:
    """The corpus as texts of WORDS_PER_TEXT words, one JSON object a line: the source file as the label and
    whether the text mentions privacy as the sensitive attribute."""
    lines = []
    for label, source in enumerate(corpus):
        words = source.read_text(encoding="utf-8", errors="replace").split()
        for start in range(0, len(words) - WORDS_PER_TEXT + 1, WORDS_PER_TEXT):
            text = " ".join(words[start : start + WORDS_PER_TEXT])
            lines.append(json.dumps({"text": text, "label": label, ATTRIBUTE: int("privacy" in text.lower())}))
    lines = lines[:limit]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def summarise(points: list[dict]) -> None:
    """Each text attack's metrics per sigma, and the sequential inversion's cost."""
    for point in points:
        print(f"sigma {point['noise_sigma']}:")
        for name, entry in sorted(point.get("attacks", {}).items()):
            if entry.get("status") != "ok":
                print(f"  {name:22s} {entry.get('status')}: {str(entry.get('reason', ''))[:160]}")
                continue
            metrics = entry.get("metrics", {})
            shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))
            print(f"  {name:22s} {entry.get('outcome', '')}: {shown}")
            details = entry.get("details", {})
            if name == "sequential-inversion":
                print(
                    f"  {'':22s} {details.get('seconds_per_sentence', float('nan')):.3g} s per sentence "
                    f"({details.get('sentences_inverted')} sentences, {details.get('candidates')} candidates, "
                    f"beam {details.get('beam')}); prefix states {str(details.get('prefix_states', ''))[:60]}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", nargs="+", type=Path, help="text files (default: the repository's Markdown)")
    parser.add_argument("--out", type=Path, default=Path("hf-text-audit"))
    parser.add_argument("--sigmas", default="0,1,4")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--texts", type=int, default=600, help="lines of the .jsonl (aux and target together)")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--split-layer", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacks", default="all", help="the sweep's --attacks (default all)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--per-sigma", action="store_true", help="one `splitaudit run` per sigma, not a sweep")
    parser.add_argument("--run-timeout", type=float, help="with --per-sigma: seconds each run may take")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more sweep options, verbatim")
    args = parser.parse_args()
    corpus = args.corpus or sorted(p for p in ROOT.glob("**/*.md") if ".ci-venv" not in p.parts)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint, texts = args.out / "checkpoint", args.out / "texts.jsonl"
    start = time.perf_counter()
    build_checkpoint(checkpoint, corpus, args)
    print(
        f"checkpoint and tokenizer built in {time.perf_counter() - start:.1f} s; {write_texts(texts, corpus, args.texts)} texts"
    )
    common = [
        str(checkpoint), "--aux", str(texts), "--split-layer", str(args.split_layer),
        "--max-length", str(args.max_length), "--label-column", "label", "--attr-column", ATTRIBUTE, "--attacks", args.attacks, "--device", args.device,
        "--seed", str(args.seed), *(["--quick"] if args.quick else []), *args.extra,
    ]  # fmt: skip
    if args.per_sigma:
        sys.exit(run_per_sigma(common, args))
    code = timed(["splitaudit", "sweep", *common, "--noise-sigma", args.sigmas, "--out", str(args.out / "sweep")])
    sweep_file = args.out / "sweep" / "sweep.json"
    if sweep_file.is_file():
        summarise(json.loads(sweep_file.read_text())["points"])
    sys.exit(code)


def run_per_sigma(common: list[str], args) -> int:
    """One `splitaudit run` per sigma, each stopped after `--run-timeout` seconds; the worst exit code."""
    codes = []
    for sigma in args.sigmas.split(","):
        out = args.out / f"sigma-{sigma}"
        codes.append(timed(["splitaudit", "run", *common, "--noise-sigma", sigma, "--out", str(out)], args.run_timeout))
        report = out / "report.json"
        if report.is_file():
            summarise([json.loads(report.read_text())])
    return max(codes)


def timed(command: list[str], timeout: float | None = None) -> int:
    """Run `command` as a user would, print its exit code and wall time (124 when stopped at `timeout`)."""
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    try:
        code = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = 124
    print(f"exit {code} in {time.perf_counter() - start:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    main()
