"""Real data every machine has, for the examples and the benchmark: scikit-learn's handwritten
digits (1797 8x8 images, 10 classes, shipped inside scikit-learn), and the MLP they train.

    x_train, y_train, x_test, y_test = digits(seed=0)
    model = digits_mlp(hidden=256)
"""

from __future__ import annotations

import torch


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardized digits, split 80/20 by a permutation fixed by `seed`:
    (x_train, y_train, x_test, y_test)."""
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
