"""Recognising, in ``load_state_dict``, the state_dict that ``state_dict()`` just produced,
unchanged: Accelerate's ``AcceleratedOptimizer`` calls ``opt.load_state_dict(opt.state_dict())``
when it is built, and writing that back would rewrite the whole optimizer state through the
store for nothing (optimizer.py)."""
from __future__ import annotations

import copy
import weakref
from typing import Any

import numpy as np
import torch


def exported_mark(produced: dict, exported: dict, slots: list) -> dict | None:
    """What ``state_dict()`` just produced, to recognise it unchanged in ``load_state_dict``:
    each of its tensors (by identity, weakly, and torch's in-place write counter ``_version``),
    its groups, the store's tensor versions it was read at, and each parameter's write counter,
    if the model then held the store's values (else loading it would write the model's, and
    must). None when the model's parameters differ from the store's."""
    for slot in slots:
        stored = exported["tensors"].get(slot.store_name)
        if stored is None:
            return None
        stored = torch.from_numpy(np.asarray(stored))
        if not torch.equal(slot.tensor.detach().to(device="cpu", dtype=stored.dtype).reshape(stored.shape), stored):
            return None
    return {"state": {i: {k: (weakref.ref(v), _writes(v)) if isinstance(v, torch.Tensor) else ("value", v)
                          for k, v in entries.items()} for i, entries in produced["state"].items()},
            "groups": copy.deepcopy(produced["param_groups"]),
            "params": [(weakref.ref(s.tensor), _writes(s.tensor)) for s in slots],
            "versions": {s.store_name: exported["tensor_versions"][s.store_name] for s in slots}}


def _writes(t: torch.Tensor) -> int:
    """How many times ``t`` was written in place: torch's counter (``Tensor._version``, which
    autograd checks; torch gives it no public name)."""
    return getattr(t, "_version")


def mark_unchanged(mark: dict | None, state_dict: dict, slots: list, store_tensors: Any) -> bool:
    """True when ``state_dict`` is the one ``mark`` recorded, unchanged (the same tensor objects,
    not written in place since; the same groups), the parameters were not written since, and the
    store's tensors are at the versions it was read at (``store_tensors()``: their rows, one
    metadata read): loading it would write back exactly what the store holds."""
    if mark is None or len(mark["params"]) != len(slots):
        return False
    try:
        if state_dict["param_groups"] != mark["groups"] or set(state_dict["state"]) != set(mark["state"]):
            return False
    except RuntimeError:                 # a group value that is a tensor of several elements: compare no further
        return False
    for index, entries in mark["state"].items():
        given = state_dict["state"][index]
        if not isinstance(given, dict) or set(given) != set(entries):
            return False
        for key, (ref, version) in entries.items():
            value = given[key]
            if ref == "value":
                if isinstance(value, torch.Tensor) or value != version:
                    return False
            elif ref() is not value or _writes(value) != version:
                return False
    if any(ref() is not s.tensor or _writes(s.tensor) != version for (ref, version), s in zip(mark["params"], slots)):
        return False
    now = {row["name"]: row["version"] for row in store_tensors()}
    return all(now.get(name) == version for name, version in mark["versions"].items())
