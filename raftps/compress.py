"""Gradient compression: encoded on the worker, decoded deterministically in the state machine.

A push names its encoded tensors in an ``encoding`` field; every other tensor in it is dense.

- ``{"kind": "fp16", "scale": s}``: the tensor travels as float16 holding ``g * s``; the store
  decodes ``float32(x) / s``. The worker picks s as a power of two that puts the largest |g|
  near 2**14 (well inside fp16's 65504, and small values above its 6e-8 subnormal floor), so
  the division is exact and the only loss is fp16's 11-bit mantissa. 2 bytes per element.
- ``{"kind": "topk"}``: the tensor travels as its k kept values (the tensor's dtype, 1-D) and
  ``NAME:indices``, their flat positions (int32 or int64, 1-D, strictly increasing, so no
  duplicates and a check that costs one pass). The store scatters them into zeros and applies
  the tensor's optimizer to that dense gradient. 8 (int32) bytes per kept value, so the
  payload and the log scale with k. The worker keeps what it did not send (error feedback).
- ``{"kind": "int8", "block": B, "scales": S}``: block-wise absmax quantisation (Dettmers et al.
  2022, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861, with linear codes): the
  flattened tensor is cut into blocks of B elements (the last may be shorter), block i travels
  as int8 codes ``round(g / S[i])`` in [-127, 127] with ``S[i] = max|g in block i| / 127``
  (a float32 value; 1.0 for an all-zero block), S the list of ceil(n / B) scales in the
  encoding entry itself (so it routes with its tensor and fits a log entry's msgpack, where
  arrays live only under ``tensors``). The store decodes ``dtype(q) * dtype(S[i])``. 1 + 8/B
  bytes per element (a scale is a msgpack float64): B = 256 gives 0.258x float32's bytes.

- ``{"kind": "rows"}``: a row-sparse gradient (``nn.Embedding(sparse=True)``): the tensor travels
  as the values of k rows, shape ``(k, *tensor.shape[1:])`` in the tensor's dtype, and
  ``NAME:indices`` their row numbers (int32 or int64, 1-D, strictly increasing: coalesced). The
  store does not densify it: it applies the optimizer to those rows only (machine.py), so bytes and
  apply cost grow with k, not the table. ``encode_rows`` sorts and sums duplicate rows.

Decoding uses only casts, division and a scatter to distinct positions: every replica gets the
same bits. Nothing here is random.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from raftps.errors import InvalidGradient, InvalidRequest

INDICES_SUFFIX = ":indices"
FP16_TARGET = 2.0 ** 14
INDEX_DTYPES = (np.dtype("int32"), np.dtype("int64"))
KINDS = ("fp16", "int8", "topk", "rows")
DENSE_KINDS = ("fp16", "int8")     # decode to a dense array of the tensor's shape (a sync step takes these)
INT8_BLOCK = 256
INT8_MAX_BLOCK = 1 << 20


@dataclass(frozen=True)
class Rows:
    """A decoded row-sparse gradient: ``values[i]`` is the gradient of row ``indices[i]``;
    indices strictly increasing and in range (checked by the decoder)."""
    indices: np.ndarray
    values: np.ndarray


# ---- worker side ---------------------------------------------------------------------------

def fp16_scale(grad: np.ndarray) -> float:
    """A power of two s with max|g| * s close to 2**14 (1.0 for an all-zero gradient)."""
    peak = float(np.max(np.abs(grad))) if grad.size else 0.0
    if peak == 0.0 or not math.isfinite(peak):
        return 1.0
    return 2.0 ** math.floor(math.log2(FP16_TARGET / peak))


def encode_fp16(grad: np.ndarray) -> tuple[np.ndarray, dict]:
    scale = fp16_scale(grad)
    return (grad * grad.dtype.type(scale)).astype(np.float16), {"kind": "fp16", "scale": scale}


def encode_int8(grad: np.ndarray, block: int = INT8_BLOCK) -> tuple[np.ndarray, dict]:
    """(int8 codes of grad's shape, its encoding entry): see the module docstring."""
    flat = grad.reshape(-1)
    count = -(-flat.size // block)
    padded = np.zeros(count * block, grad.dtype)
    padded[:flat.size] = flat
    padded = padded.reshape(count, block)
    scales = (np.max(np.abs(padded), axis=1) / grad.dtype.type(127)).astype(np.float32) if count \
        else np.zeros(0, np.float32)
    scales[scales == 0] = 1.0          # an all-zero block (or one below float32's range): codes of 0
    codes = np.clip(np.rint(padded / scales[:, None].astype(grad.dtype)), -127, 127).astype(np.int8)
    return codes.reshape(-1)[:flat.size].reshape(grad.shape), {"kind": "int8", "block": block,
                                                               "scales": scales.tolist()}


def topk_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Flat positions of the k largest |values|, ascending. argpartition is O(n) (a full sort of
    a 1M-element layer cost 80 ms a push); its choice among ties is implementation-defined, which
    is harmless here: selection happens on the worker, the store only checks and scatters."""
    flat = np.abs(values.ravel())
    order = np.argpartition(flat, flat.size - k)[flat.size - k:] if k < flat.size else np.arange(flat.size)
    return np.sort(order).astype(np.int32 if flat.size < 2**31 else np.int64)


class TopK:
    """Top-k with error feedback (Stich et al. 2018): e <- e + g; send the k largest |e|; e[sent] <- 0."""

    def __init__(self, fraction: float):
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.residual: dict[str, np.ndarray] = {}

    def encode(self, name: str, grad: np.ndarray) -> tuple[dict[str, np.ndarray], dict]:
        e = self.residual.get(name)
        e = grad.copy() if e is None else e + grad
        k = max(1, int(round(self.fraction * e.size)))
        idx = topk_indices(e, k)
        flat = e.reshape(-1)
        values = flat[idx].copy()
        flat[idx] = 0
        self.residual[name] = e
        return {name: values, name + INDICES_SUFFIX: idx}, {"kind": "topk"}


def encode_rows(name: str, rows: np.ndarray, values: np.ndarray) -> tuple[dict[str, np.ndarray], dict]:
    """A row-sparse push of tensor ``name``: (tensors entries, encoding entry). ``rows`` may be
    unsorted and repeat a row (torch's uncoalesced sparse gradients): repeated rows are summed."""
    rows, values = np.asarray(rows), np.asarray(values)
    if rows.ndim != 1 or not (rows.dtype.kind in "iu" or rows.size == 0):
        raise InvalidRequest(f"tensor {name!r}: row indices must be a 1-D integer array, got {rows.dtype} "
                             f"of shape {rows.shape}")
    if values.ndim < 1 or len(values) != len(rows):
        raise InvalidRequest(f"tensor {name!r}: {len(rows)} row indices but values of shape {values.shape}")
    if rows.size and int(rows.min()) < 0:
        raise InvalidGradient(f"tensor {name!r}: negative row index {int(rows.min())}")
    if rows.size > 1 and not bool(np.all(rows[1:] > rows[:-1])):
        order = np.argsort(rows, kind="stable")
        rows, values = rows[order], values[order]
        starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
        rows, values = rows[starts], np.add.reduceat(values, starts, axis=0)
    index_dtype = np.int32 if not rows.size or int(rows[-1]) < 2**31 else np.int64
    return ({name: np.ascontiguousarray(values), name + INDICES_SUFFIX: rows.astype(index_dtype)},
            {name: {"kind": "rows"}})


def encode_push(grads: dict[str, np.ndarray], method: str, topk: TopK | None = None) -> tuple[dict, dict | None]:
    """(tensors to send, encoding field or None) for ``method`` none | fp16 | topk."""
    if method == "none":
        return grads, None
    tensors: dict[str, np.ndarray] = {}
    encoding: dict[str, dict] = {}
    for name, grad in grads.items():
        if method == "fp16":
            tensors[name], encoding[name] = encode_fp16(grad)
        elif method == "int8":
            tensors[name], encoding[name] = encode_int8(grad)
        elif method == "topk":
            parts, encoding[name] = topk.encode(name, grad)
            tensors.update(parts)
        else:
            raise ValueError(f"unknown compression {method!r} (none, fp16, int8, topk)")
    return tensors, encoding


def parse(text: str) -> tuple[str, float]:
    """'none' | 'fp16' | 'int8' | 'topk:FRACTION' -> (method, fraction)."""
    if text in ("none", "fp16", "int8"):
        return text, 1.0
    if text.startswith("topk:"):
        fraction = float(text.split(":", 1)[1])
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        return "topk", fraction
    raise ValueError(f"unknown compression {text!r}: none, fp16, int8 or topk:FRACTION")


# ---- state machine side --------------------------------------------------------------------

def decode_push(tensors: dict[str, np.ndarray], encoding: Any,
                like: dict[str, np.ndarray]) -> dict[str, np.ndarray | Rows]:
    """Gradients from a push's tensors and its encoding field: dense arrays, or Rows for the
    "rows" kind. ``like`` maps each pushed tensor's name to the stored array (shape and dtype).
    Raises InvalidRequest/InvalidGradient."""
    if encoding is None:
        return tensors
    if not isinstance(encoding, dict) or not encoding:
        raise InvalidRequest("'encoding' must be a non-empty map of tensor name -> {kind: ...}")
    if not all(isinstance(name, str) for name in encoding):
        raise InvalidRequest("'encoding' must map tensor names (strings) to {kind: ...}")
    out = {}
    used = set()
    for name in sorted(encoding):
        enc = encoding[name]
        if not isinstance(enc, dict) or not isinstance(enc.get("kind"), str) or enc["kind"] not in KINDS:
            raise InvalidRequest(f"tensor {name!r}: encoding must be {{'kind': 'fp16'|'int8'|'topk'|'rows', ...}}, "
                                 f"got {enc!r}")
        if name not in like:
            raise InvalidRequest(f"tensor {name!r}: encoded but not known to the store")
        if name not in tensors:
            raise InvalidRequest(f"tensor {name!r}: encoded but its values are not in the push")
        target = like[name]
        if enc["kind"] == "fp16":
            out[name] = _decode_fp16(name, tensors[name], enc, target)
            used.add(name)
        elif enc["kind"] == "int8":
            out[name] = _decode_int8(name, tensors[name], enc, target)
            used.add(name)
        elif enc["kind"] == "topk":
            out[name] = _decode_topk(name, tensors[name], tensors.get(name + INDICES_SUFFIX), target)
            used.update((name, name + INDICES_SUFFIX))
        else:
            out[name] = _decode_rows(name, tensors[name], tensors.get(name + INDICES_SUFFIX), target)
            used.update((name, name + INDICES_SUFFIX))
    for name in tensors:
        if name not in used:
            if name in encoding or name.endswith(INDICES_SUFFIX) and name[:-len(INDICES_SUFFIX)] in encoding:
                raise InvalidRequest(f"tensor {name!r}: unexpected in this encoded push")
            out[name] = tensors[name]
    return {name: out[name] for name in sorted(out)}


def _decode_fp16(name: str, x: np.ndarray, enc: dict, target: np.ndarray) -> np.ndarray:
    scale = enc.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise InvalidRequest(f"tensor {name!r}: fp16 scale must be a finite number > 0, got {scale!r}")
    if x.dtype != np.float16:
        raise InvalidRequest(f"tensor {name!r}: fp16 encoding needs float16 values, got {x.dtype}")
    if x.shape != target.shape:
        raise InvalidRequest(f"tensor {name!r}: fp16 values of shape {x.shape}, the tensor is {target.shape}")
    t = target.dtype.type
    return x.astype(target.dtype) / t(scale)


def _decode_int8(name: str, x: np.ndarray, enc: dict, target: np.ndarray) -> np.ndarray:
    block, scales = enc.get("block"), enc.get("scales")
    if type(block) is not int or not 1 <= block <= INT8_MAX_BLOCK:
        raise InvalidRequest(f"tensor {name!r}: int8 block must be an int in [1, {INT8_MAX_BLOCK}], got {block!r}")
    if not isinstance(x, np.ndarray) or x.dtype != np.int8:
        raise InvalidRequest(f"tensor {name!r}: int8 encoding needs int8 values, got {getattr(x, 'dtype', type(x))}")
    if x.shape != target.shape:
        raise InvalidRequest(f"tensor {name!r}: int8 values of shape {x.shape}, the tensor is {target.shape}")
    count = -(-x.size // block)
    if not isinstance(scales, list) or len(scales) != count \
            or not all(type(v) in (int, float) for v in scales):
        length = len(scales) if isinstance(scales, (list, tuple, np.ndarray)) else None
        raise InvalidRequest(f"tensor {name!r}: int8 scales must be a list of {count} numbers (one per block of "
                             f"{block}), got {type(scales).__name__} of length {length}")
    scales = np.asarray(scales, np.float64)
    if count and not (bool(np.all(np.isfinite(scales))) and bool(np.all(scales > 0))):
        raise InvalidRequest(f"tensor {name!r}: int8 scales must be finite and > 0")
    t = target.dtype
    per_element = np.repeat(scales.astype(t), block)[:x.size]
    return (x.reshape(-1).astype(t) * per_element).reshape(target.shape)


def _decode_topk(name: str, values: np.ndarray, idx: np.ndarray | None, target: np.ndarray) -> np.ndarray:
    if idx is None:
        raise InvalidRequest(f"tensor {name!r}: top-k encoding needs {name + INDICES_SUFFIX!r}")
    if idx.dtype not in INDEX_DTYPES:
        raise InvalidRequest(f"tensor {name!r}: top-k indices must be int32 or int64, got {idx.dtype}")
    if values.dtype != target.dtype:
        raise InvalidRequest(f"tensor {name!r}: top-k values are {values.dtype}, the tensor is {target.dtype}")
    if idx.ndim != 1 or values.ndim != 1 or len(idx) != len(values):
        raise InvalidRequest(f"tensor {name!r}: top-k needs 1-D indices and values of equal length, "
                             f"got shapes {idx.shape} and {values.shape}")
    if len(idx):
        if int(idx[0]) < 0 or int(idx[-1]) >= target.size:
            raise InvalidGradient(f"tensor {name!r}: top-k index out of range [0, {target.size})")
        if len(idx) > 1 and not bool(np.all(idx[1:] > idx[:-1])):
            raise InvalidGradient(f"tensor {name!r}: top-k indices must be strictly increasing (no duplicates)")
    dense = np.zeros(target.size, target.dtype)
    dense[idx] = values
    return dense.reshape(target.shape)


def _decode_rows(name: str, values: np.ndarray, idx: np.ndarray | None, target: np.ndarray) -> Rows:
    key = name + INDICES_SUFFIX
    if idx is None:
        raise InvalidRequest(f"tensor {name!r}: rows encoding needs the row numbers in {key!r}")
    if idx.dtype not in INDEX_DTYPES or idx.ndim != 1:
        raise InvalidRequest(f"tensor {name!r}: {key!r} must be a 1-D int32 or int64 array, got {idx.dtype} "
                             f"of shape {idx.shape}")
    if target.ndim < 1:
        raise InvalidRequest(f"tensor {name!r}: a scalar tensor has no rows")
    if values.dtype != target.dtype:
        raise InvalidRequest(f"tensor {name!r}: row values are {values.dtype}, the tensor is {target.dtype}")
    want = (len(idx), *target.shape[1:])
    if values.shape != want:
        raise InvalidRequest(f"tensor {name!r}: {len(idx)} rows need values of shape {want}, got {values.shape}")
    if len(idx) > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        raise InvalidGradient(f"tensor {name!r}: row indices must be strictly increasing (sorted, no "
                              f"duplicates): use raftps.compress.encode_rows")
    if len(idx) and (int(idx[0]) < 0 or int(idx[-1]) >= target.shape[0]):     # sorted: the ends suffice
        raise InvalidGradient(f"tensor {name!r}: row index out of range [0, {target.shape[0]})")
    return Rows(idx, values)
