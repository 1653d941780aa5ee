"""Generated data for the anisotropic and 1-D bottoms of tests/support/architectures.py (nothing is downloaded).

- `text_lines`: 3x48x192 rendered text lines in [0, 1]: a line of glyphs from a fixed random
  alphabet (with ascenders and descenders, so that a line has a top and a bottom) on light
  paper; label 1 when the line is turned 180 degrees (the direction classifier's task), the
  attribute the ink colour (black or blue).
- `audio_clips`: C x T sensor or audio series: a tone whose frequency depends on the class
  (4 classes) under a rising or falling envelope (the attribute), plus noise; not in [0, 1].
- `spectrograms`: 1x64x400 log-magnitude spectrograms of such clips, scaled to [0, 1].
"""

from __future__ import annotations

import numpy as np
import torch

GLYPHS, GLYPH_HEIGHT, GLYPH_WIDTH, GLYPH_STEP = 24, 20, 9, 12
X_HEIGHT = slice(8, 16)  # rows of a glyph every letter fills partly; above: ascenders, below: descenders
INK = {0: (0.05, 0.05, 0.05), 1: (0.1, 0.15, 0.6)}  # black, blue
LINE_SHIFT = 6


def text_lines(
    n: int, seed: int = 0, height: int = 48, width: int = 192, shift: int = LINE_SHIFT
) -> tuple[np.ndarray, ...]:
    """(x float32 n x 3 x height x width in [0, 1], label: turned 180 degrees, attribute: blue ink).

    Each line sits up to `shift` rows above or below the middle, as cropped lines do: centred
    lines differ between upright and turned in where their x-height band lies, and k-means on
    the raw pixels told them apart perfectly (accuracy 1.0), a baseline no attack can beat."""
    gen = torch.Generator().manual_seed(seed)
    alphabet = _alphabet(gen)
    y = torch.arange(n) % 2
    attr = torch.randint(0, 2, (n,), generator=gen)
    paper = 0.85 + 0.1 * torch.rand(n, 1, 1, 1, generator=gen)
    ink_mask = torch.zeros(n, 1, height, width)
    tops = (height - GLYPH_HEIGHT) // 2 + torch.randint(-shift, shift + 1, (n,), generator=gen)
    for i, top in enumerate(tops.tolist()):
        letters = torch.randint(0, GLYPHS, (width // GLYPH_STEP,), generator=gen)
        start = int(torch.randint(0, GLYPH_STEP, (1,), generator=gen))
        for k, letter in enumerate(letters.tolist()):
            left = start + k * GLYPH_STEP
            if left + GLYPH_WIDTH <= width:
                ink_mask[i, 0, top : top + GLYPH_HEIGHT, left : left + GLYPH_WIDTH] = alphabet[letter]
    ink = torch.tensor([INK[int(a)] for a in attr]).view(n, 3, 1, 1)
    x = paper * (1 - ink_mask) + ink * ink_mask + 0.02 * torch.randn(n, 3, height, width, generator=gen)
    x = torch.where(y.view(n, 1, 1, 1).bool(), x.flip(-1, -2), x).clamp(0, 1)
    return x.numpy().astype(np.float32), y.numpy(), attr.numpy()


def _alphabet(gen: torch.Generator) -> torch.Tensor:
    """GLYPHS binary glyphs: strokes in the x-height band, some with an ascender or a descender."""
    glyphs = torch.zeros(GLYPHS, GLYPH_HEIGHT, GLYPH_WIDTH)
    for g in range(GLYPHS):
        body = (torch.rand(X_HEIGHT.stop - X_HEIGHT.start, GLYPH_WIDTH, generator=gen) < 0.45).float()
        glyphs[g, X_HEIGHT] = body
        stem = int(torch.randint(1, GLYPH_WIDTH - 1, (1,), generator=gen))
        if g % 3 == 0:
            glyphs[g, : X_HEIGHT.start, stem : stem + 2] = 1  # ascender
        elif g % 3 == 1:
            glyphs[g, X_HEIGHT.stop : X_HEIGHT.stop + 4, stem : stem + 2] = 1  # short descender
    return glyphs


def audio_clips(n: int, seed: int = 0, channels: int = 1, length: int = 1024) -> tuple[np.ndarray, ...]:
    """(x float32 n x channels x length, class 0-3: the tone's frequency, attribute: rising envelope)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4
    attr = torch.randint(0, 2, (n,), generator=gen)
    t = torch.linspace(0, 1, length).view(1, 1, length)
    cycles = (8.0 * 2 ** (y.float() / 2)).view(n, 1, 1)
    phase = 2 * torch.pi * torch.rand(n, channels, 1, generator=gen)
    envelope = torch.where(attr.view(n, 1, 1).bool(), 0.3 + 0.7 * t, 1.0 - 0.7 * t)
    x = envelope * torch.sin(2 * torch.pi * cycles * t + phase) + 0.1 * torch.randn(n, channels, length, generator=gen)
    return x.numpy().astype(np.float32), y.numpy(), attr.numpy()


SPECTROGRAM_HOP = 16


def spectrograms(n: int, seed: int = 0, bins: int = 64, frames: int = 400) -> tuple[np.ndarray, ...]:
    """(x float32 n x 1 x bins x frames in [0, 1], class, attribute) of `audio_clips` whose
    short-time Fourier transform has `bins` frequencies and `frames` frames."""
    x, y, attr = audio_clips(n, seed, length=SPECTROGRAM_HOP * (frames - 1) + 1)
    window = torch.hann_window(2 * bins - 1)
    stft = torch.stft(torch.from_numpy(x[:, 0]), 2 * bins - 1, SPECTROGRAM_HOP, window=window, return_complex=True)
    log = stft.abs().add(1e-3).log()
    scaled = (log - log.min()) / (log.max() - log.min())
    return scaled.unsqueeze(1).numpy().astype(np.float32), y, attr
