"""The names a training job keeps in the store besides its parameters. All of them are under
the job's prefix, so a role on ``PREFIX/`` (rbac.py) covers everything the job writes."""


def tensor(prefix: str, name: str) -> str:
    """A model parameter or buffer ``name`` (as in ``named_parameters()``)."""
    return f"{prefix}/{name}"


def step_counter(prefix: str, rank: int) -> str:
    """Rank ``rank``'s count of applied steps (async modes), pushed with the gradients it counts."""
    return f"{prefix}/_raftps/steps.rank{rank}"


def group(prefix: str) -> str:
    """The job's sync group (its step sequence) and SSP group."""
    return f"{prefix}/_raftps/group"
