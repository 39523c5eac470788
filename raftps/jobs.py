"""The names a training job keeps in the store besides its parameters. All of them are under
the job's prefix, so a role on ``PREFIX/`` (rbac.py) covers everything the job writes."""
from __future__ import annotations

from raftps.deprecated import renamed_function
from raftps.errors import UsageError
from raftps.groups import group_of
from raftps.tensor import NAME_RE

INTERNAL = "_raftps/"          # under PREFIX/: the job's own bookkeeping (step counters, DiLoCo's), not its model
MAX_STEP_TIMEOUT = 600.0       # seconds a sync step (a DiLoCo round) may wait for its last contribution


def prefix_root(prefix: str) -> str:
    """``P/`` for prefix ``P`` (a trailing slash is optional): ``job1`` selects ``job1/...``, never ``job10/...``."""
    root = (prefix or "").rstrip("/")
    if not root or not NAME_RE.fullmatch(root):
        raise UsageError(f"bad prefix {prefix!r}: 1-200 characters from [A-Za-z0-9_.:/-], e.g. 'job1'")
    return root + "/"


def tensor(prefix: str, name: str) -> str:
    """A model parameter or buffer ``name`` (as in ``named_parameters()``)."""
    return f"{prefix}/{name}"


def step_counter(prefix: str, rank: int, raft_group: int = 0, groups: int = 1) -> str:
    """Rank ``rank``'s count of applied steps (async modes), pushed with the gradients it counts.
    With several Raft groups, one per group, named so that it lives in ``raft_group`` (a push is
    atomic within a group only, so each group counts the steps it applied)."""
    if groups == 1:
        return f"{prefix}/_raftps/steps.rank{rank}"
    return next(name for name in (f"{prefix}/_raftps/steps.rank{rank}.g{raft_group}.{j}" for j in range(100_000))
                if group_of(name, groups) == raft_group)


def skip_flag(prefix: str, raft_group: int = 0, groups: int = 1) -> str:
    """The tensor a sync step's contributions carry in ``raft_group`` to say "this rank skips the
    step" (1.0; else 0.0): a step any rank skips applies no gradient (aggregate.py). One per Raft
    group, named so that it lives there, as ``step_counter``'s. A tensor, not a field of push_step:
    a skipped step's entry applies only the step's ``elastic`` tensors, and in a group that holds
    none of the model's (no buffers there) the flag is the one it carries; a step entry with
    no tensor at all is refused by the state machine (machine.py), on replicas of every version."""
    if groups == 1:
        return f"{prefix}/{INTERNAL}skip"
    return next(name for name in (f"{prefix}/{INTERNAL}skip.g{raft_group}.{j}" for j in range(100_000))
                if group_of(name, groups) == raft_group)


def is_skip_flag(name: str) -> bool:
    """Whether tensor ``name`` is a job's ``skip_flag``."""
    last = name.rpartition("/" + INTERNAL)[2]
    return "/" + INTERNAL in name and (last == "skip" or last.startswith("skip.g"))


def job_name(prefix: str) -> str:
    """The name of the job's step sequence (its ``job``), also its SSP group's name. The stored
    name keeps the word it was given when "group" meant a job: running jobs' steps are under it."""
    return f"{prefix}/_raftps/group"


def diloco_job(prefix: str, fragment: int, fragments: int) -> str:
    """The round sequence (a job) of fragment ``fragment`` of ``fragments`` in a DiLoCo job
    (diloco.py): F names a layout, so a job resumed with another F starts new round counters."""
    return f"{prefix}/_raftps/diloco.f{fragment}of{fragments}"


def diloco_rounds(prefix: str, rank: int, fragments: int) -> str:
    """Rank ``rank``'s count of applied rounds per fragment (asynchronous DiLoCo), pushed with the
    pseudo-gradients it counts."""
    return f"{prefix}/_raftps/diloco.rounds.rank{rank}.of{fragments}"


# The names of before "group" stopped meaning a job (Design: Words); the same functions.
group = renamed_function(job_name, "jobs.group")
diloco_group = renamed_function(diloco_job, "jobs.diloco_group")
