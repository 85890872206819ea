"""The FL jobs' model in plain numpy: features -> 32 ReLU -> classes, trained with minibatch SGD.

The same architecture as ``runtime._model`` (PyTorch), written out so that a Flower ClientApp,
which Flower's deployment runtime starts as a fresh process for every message, needs only numpy:
importing torch there would add seconds of CPU to every round of every node.
Parameters are a list of arrays [W1 (features x 32), b1, W2 (32 x classes), b2], the form
Flower's ``ArrayRecord`` carries.
"""

from __future__ import annotations

import numpy as np

HIDDEN = 32
LEARNING_RATE = 0.1
BATCH = 16

Params = list[np.ndarray]


def init_params(features: int, classes: int, seed: int) -> Params:
    """He-uniform first layer, Glorot-uniform second (what ``torch.nn.Linear`` draws, roughly)."""
    rng = np.random.default_rng(seed)
    b1, b2 = 1.0 / np.sqrt(features), 1.0 / np.sqrt(HIDDEN)
    return [
        rng.uniform(-b1, b1, (features, HIDDEN)).astype(np.float32),
        rng.uniform(-b1, b1, HIDDEN).astype(np.float32),
        rng.uniform(-b2, b2, (HIDDEN, classes)).astype(np.float32),
        rng.uniform(-b2, b2, classes).astype(np.float32),
    ]


def _forward(params: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w1, b1, w2, b2 = params
    hidden = np.maximum(x @ w1 + b1, 0.0)
    return hidden, hidden @ w2 + b2


def local_update(params: Params, x: np.ndarray, y: np.ndarray, epochs: int, seed: int) -> Params:
    """``epochs`` passes of minibatch SGD (cross-entropy) over (x, y), from ``params``."""
    rng = np.random.default_rng(seed)
    w1, b1, w2, b2 = (p.astype(np.float32, copy=True) for p in params)
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(order), BATCH):
            idx = order[start : start + BATCH]
            xb, yb = x[idx], y[idx]
            hidden = np.maximum(xb @ w1 + b1, 0.0)
            logits = hidden @ w2 + b2
            logits -= logits.max(axis=1, keepdims=True)
            prob = np.exp(logits)
            prob /= prob.sum(axis=1, keepdims=True)
            prob[np.arange(len(idx)), yb] -= 1.0
            grad_logits = prob / len(idx)
            grad_hidden = (grad_logits @ w2.T) * (hidden > 0)
            w2 -= LEARNING_RATE * hidden.T @ grad_logits
            b2 -= LEARNING_RATE * grad_logits.sum(axis=0)
            w1 -= LEARNING_RATE * xb.T @ grad_hidden
            b1 -= LEARNING_RATE * grad_hidden.sum(axis=0)
    return [w1, b1, w2, b2]


def accuracy(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    """Share of (x, y) classified right."""
    return float((_forward(params, x)[1].argmax(axis=1) == y).mean())
