"""Real data every machine has, for the examples and the benchmark, and the models they train:
scikit-learn's handwritten digits (1797 8x8 images, 10 classes, shipped inside scikit-learn) with
an MLP, and the Python standard library's own source text with a small character-level
transformer (nanoGPT-style: causal self-attention, pre-LayerNorm, tied embeddings).

    x_train, y_train, x_test, y_test = digits(seed=0)
    model = digits_mlp(hidden=256)
    text = stdlib_text(1_000_000)
    model = CharLM(vocab=len(set(text)), block=64, d=64, layers=2, heads=4)
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def digits(
    seed: int = 0, scale: str = "standard"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits split 80/20 by a permutation fixed by `seed`: (x_train, y_train, x_test,
    y_test); standardized by the training set's mean and deviation (scale "standard") or
    divided by 16 into [0, 1] (scale "unit", as they are often used)."""
    if scale not in ("standard", "unit"):
        raise ValueError(f"scale={scale!r}: 'standard' or 'unit'")
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            "the digits data needs scikit-learn: pip install 'cloudtrain[examples]'"
        ) from e
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)  # (1797, 64)
    y = torch.tensor(data.target, dtype=torch.int64)  # (1797,)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_train = int(0.8 * len(x))
    if scale == "unit":
        x = x / 16
    else:
        mean, std = x[:n_train].mean(0), x[:n_train].std(0).clamp_min(1e-3)
        x = (x - mean) / std
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def digits_mlp(hidden: int = 256) -> torch.nn.Module:
    """64 -> hidden -> hidden -> 10, ReLU."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def stdlib_text(chars: int) -> str:
    """The stdlib's top-level .py files in sorted order, concatenated, cut at `chars`: the same
    Python gives the same text on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= chars:
            break
    if not parts:
        raise SystemExit(f"no .py files in {root}: this Python ships its stdlib without sources")
    return "".join(parts)[:chars]


def windows(
    data: torch.Tensor, starts: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets at `starts`: two (len(starts), block) tensors."""
    rows = starts[:, None] + torch.arange(block + 1)  # (n, block + 1)
    chunk = data[rows]
    return chunk[:, :-1], chunk[:, 1:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)  # each (b, t, d)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d / heads)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab: int, block: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for m in self.modules():  # GPT-2's init: small weights keep the first logits near uniform
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))  # (b, t, d)
        return self.head(self.ln(self.blocks(x)))  # (b, t, vocab)
