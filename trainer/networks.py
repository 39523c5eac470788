"""Small numpy models with hand-written forward and backward passes (float32).

A model is a description (layer widths) plus pure functions of a parameter dict
``{name: array}``; the parameters themselves live in the store (or, with --local, in one
process), so workers never hold state that could diverge from it.
"""
from __future__ import annotations

import numpy as np

Params = dict[str, np.ndarray]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)   # exp of large logits would overflow
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


class MLP:
    """features -> hidden[0] -> ... -> classes, ReLU between layers, mean cross-entropy loss."""

    def __init__(self, features: int, classes: int, hidden: tuple[int, ...] = (1000, 1000)):
        self.sizes = [features, *hidden, classes]

    @property
    def layers(self) -> int:
        return len(self.sizes) - 1

    def init(self, seed: int) -> Params:
        """He-initialised weights (ReLU), zero biases; the same seed gives the same bits."""
        rng = np.random.default_rng(seed)
        params: Params = {}
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes, self.sizes[1:])):
            params[f"W{i}"] = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
            params[f"b{i}"] = np.zeros(fan_out, np.float32)
        return params

    def parameters(self) -> int:
        return sum(a * b + b for a, b in zip(self.sizes, self.sizes[1:]))

    def logits(self, params: Params, x: np.ndarray) -> np.ndarray:
        h = x
        for i in range(self.layers):
            h = h @ params[f"W{i}"] + params[f"b{i}"]
            if i < self.layers - 1:
                h = np.maximum(h, 0)
        return h

    def loss(self, params: Params, x: np.ndarray, y: np.ndarray) -> float:
        return float(-log_softmax(self.logits(params, x))[np.arange(len(y)), y].mean())

    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        """Mean cross-entropy over the batch and its gradient with respect to every parameter."""
        acts = [x]                       # inputs of each layer, kept for the backward pass
        h = x
        for i in range(self.layers):
            h = h @ params[f"W{i}"] + params[f"b{i}"]
            if i < self.layers - 1:
                h = np.maximum(h, 0)
                acts.append(h)
        logp = log_softmax(h)
        n = len(y)
        loss = float(-logp[np.arange(n), y].mean())
        # d(mean CE)/d(logits) = (softmax - onehot) / n
        d = np.exp(logp)
        d[np.arange(n), y] -= 1
        d /= d.dtype.type(n)
        grads: Params = {}
        for i in reversed(range(self.layers)):
            grads[f"W{i}"] = acts[i].T @ d
            grads[f"b{i}"] = d.sum(axis=0)
            if i:
                d = (d @ params[f"W{i}"].T) * (acts[i] > 0)   # ReLU passes gradient where it was active
        return loss, {k: grads[k].astype(params[k].dtype, copy=False) for k in params}

    def accuracy(self, params: Params, x: np.ndarray, y: np.ndarray) -> float:
        return float((self.logits(params, x).argmax(axis=1) == y).mean())

    def loss_and_accuracy(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Both from one forward pass (an evaluation of the 1M-parameter MLP costs one, not two)."""
        logits = self.logits(params, x)
        loss = float(-log_softmax(logits)[np.arange(len(y)), y].mean())
        return loss, float((logits.argmax(axis=1) == y).mean())


class Softmax(MLP):
    """Softmax regression: an MLP with no hidden layer."""

    def __init__(self, features: int, classes: int):
        super().__init__(features, classes, hidden=())


def make_model(name: str, features: int, classes: int, hidden: tuple[int, ...] = (1000, 1000)) -> MLP:
    if name == "softmax":
        return Softmax(features, classes)
    if name == "mlp":
        return MLP(features, classes, hidden)
    raise ValueError(f"unknown model {name!r} (known: mlp, softmax)")
