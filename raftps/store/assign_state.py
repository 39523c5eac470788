"""The check of an ``assign_state`` write (a torch optimizer's state_dict loaded into the store):
``records`` [{name, scalars}] and ``tensors`` {"i": the value of record i, "i.KEY": its optimizer
state array KEY}. Each tensor's state must have exactly the keys its optimizer keeps, arrays of
its shape and dtype, all finite; anything else refuses the write whole, before any tensor changes.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from raftps import optim
from raftps.errors import InvalidRequest
from raftps.optimizers import OPTIMIZERS
from raftps.tensor import Tensor, check_fits, check_name, freeze


def plan(records: Any, parts: Any, existing: Callable[[str], Tensor]) -> list[tuple[str, np.ndarray, dict]]:
    """(name, value, state) for every record, checked; ``existing(name)`` is the stored tensor
    (or raises UnknownTensor)."""
    if not isinstance(records, list) or not records or not isinstance(parts, dict):
        raise InvalidRequest("assign_state needs records ([{name, scalars}, ...]) and tensors")
    planned, used = [], set()
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("scalars"), dict):
            raise InvalidRequest(f"assign_state: records[{i}] must be a map {{name, scalars}}")
        name = check_name(record.get("name"))
        tensor = existing(name)
        if OPTIMIZERS[tensor.optimizer["name"]].bound_to_log:    # e.g. a history of the log's indices
            raise InvalidRequest(f"assign_state: tensor {name!r}: optimizer {tensor.optimizer['name']!r} keeps state "
                                 "that cannot be assigned")
        value = parts.get(str(i))
        if not isinstance(value, np.ndarray):
            raise InvalidRequest(f"assign_state: tensor {name!r} has no value (part {str(i)!r})")
        check_fits(name, value, tensor, "value")
        used.add(str(i))
        want = optim.init_state(optim.normalize(tensor.optimizer, name), tensor.data)
        given = {p.split(".", 1)[1]: v for p, v in parts.items() if p.startswith(f"{i}.")}
        given.update(record["scalars"])
        if sorted(given) != sorted(want):
            raise InvalidRequest(f"assign_state: tensor {name!r} (optimizer {tensor.optimizer['name']!r}) keeps "
                                 f"state {sorted(want)}, got {sorted(given)}")
        state = {key: _state_value(name, key, want[key], given[key], tensor) for key in sorted(want)}
        used.update(f"{i}.{key}" for key in want if isinstance(want[key], np.ndarray))
        planned.append((name, value, state))
    stray = sorted(set(parts) - used)
    if stray:
        raise InvalidRequest(f"assign_state: parts {stray[:5]} belong to no record's state")
    if len({name for name, _, _ in planned}) != len(planned):
        raise InvalidRequest("assign_state: a tensor is named twice")
    return planned


def _state_value(name: str, key: str, expected: Any, got: Any, tensor: Tensor) -> Any:
    if isinstance(expected, np.ndarray):
        if not isinstance(got, np.ndarray):
            raise InvalidRequest(f"assign_state: {name!r} state {key!r} must be an array")
        check_fits(name, got, tensor, f"state {key!r}")
        return freeze(got.copy())
    if type(expected) is int:               # a step count
        if type(got) is not int or got < 0:
            raise InvalidRequest(f"assign_state: {name!r} state {key!r} must be an int >= 0, got {got!r}")
        return got
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not 0.0 < got <= 1.0:   # Adam's beta products
        raise InvalidRequest(f"assign_state: {name!r} state {key!r} must be a number in (0, 1], got {got!r}")
    return float(got)
