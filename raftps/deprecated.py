"""Keyword arguments of the public API that were renamed: the old keyword is still accepted, with
a DeprecationWarning, so that code written against an earlier release runs unchanged.

"group" once named three things: a Raft group (an int), a job (a sync step sequence's name) and
an SSP group. Each now has a word of its own: ``raft_group``, ``job``, ``ssp_group``.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keyword(old: str, new: str) -> Callable[[F], F]:
    """Accept ``old=value`` as ``new=value`` (warning once per call site); refuse both at once."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got both {old}= (its old name) and {new}=: pass only {new}=")
                warnings.warn(f"{fn.__name__}({old}=...) is deprecated: pass {new}=... (the same value)",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def renamed_function(fn: F, old: str) -> F:
    """``fn`` under its old name ``old`` (e.g. ``"jobs.group"``): the same function, warning that
    the name is deprecated."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"{old}() is deprecated: call {fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}() "
                      "(the same function)", DeprecationWarning, stacklevel=2)
        return fn(*args, **kwargs)
    return call  # type: ignore[return-value]
