"""The seam between raftps and its Raft library.

A replica (raftps/server/node.py) and the Raft library meet here, in the spirit of hashicorp/raft's FSM
and etcd's raftexample: the replica proposes opaque entries to a ``ReplicatedLog`` and hands it an
``Applier``, which the log calls back to apply committed entries in order and to save and load
snapshots. Neither side imports the other's module. Implementations:

* ``raftps.raft.pysyncobj_log.SyncObjLog``: pysyncobj, over TCP, with the fixes of
  ``pysyncobj_fixes.py``; the only module of raftps that imports pysyncobj's syncobj.
* ``raftps.raft.memory.MemoryLog``: one member, in memory, for fast in-process tests.

Every ``Applier`` callback runs in the log's one thread (pysyncobj's tick thread), never two at
once; ``apply`` sees indices 1, 2, 3, ... in order (index 1 may be the library's own entry, which
never reaches ``apply``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from raftps.raft.durability import Durability


class NotReady(Exception):
    """Raised by ``Applier.apply``: this entry cannot be applied yet (its payload is on its way).
    The log stops before it, keeps serving heartbeats, and tries it again after ``wake()``."""


class NotApplied(Exception):
    """A proposal or read that did not complete. ``applied`` is False when it certainly had no
    effect (the caller may retry anywhere) and None when it may still be applied."""

    def __init__(self, message: str, applied: bool | None):
        super().__init__(message)
        self.applied = applied


# Raft's boundary entries of a snapshot: (the library's entry bytes, index, term).
Entry = tuple[bytes, int, int]


@dataclass(frozen=True)
class SnapshotMeta:
    """What the Raft library stores in a snapshot beside the state machine."""
    last: Entry                 # the last entry the snapshot covers
    previous: Entry             # the one before it (pysyncobj keeps both after a compaction)
    members: list[str]          # Raft addresses of every member; [] = not known (a seeded backup)

    @property
    def index(self) -> int:
        return self.last[1]


class Applier(Protocol):
    """What a replica hands its log. All calls come from the log's thread, one at a time."""

    def apply(self, entry: bytes, index: int) -> Any:
        """Apply the committed ``entry`` at ``index``; the value goes to the proposer's callback.
        Raise NotReady to stop before it; any other exception is a bug of the applier."""

    def save_snapshot(self, path: str, meta: SnapshotMeta) -> None:
        """Write the state through ``meta.index`` to ``path`` (the log renames it into place)."""

    # Optional: ``snapshot_saved(meta)``, called once the file save_snapshot wrote is in place
    # (durable logs: fsynced, with its directory). Not called if that failed. Only from then on
    # may what the snapshot covers (payload files, say) be dropped. See saved_hook().

    def load_snapshot(self, path: str) -> SnapshotMeta:
        """Replace the state by the snapshot at ``path`` and say what it covers."""

    def tick(self) -> None:
        """Called on every turn of the log's loop (at least every 50 ms): housekeeping."""


@dataclass
class RaftSettings:
    address: str                               # this member's Raft address host:port
    others: list[str]                          # every other member's
    data_dir: str                              # journal and snapshot live here
    secret: bytes                              # peer authentication; b"" = none (loopback tests only)
    bind: str | None = None                    # host:port to listen on (default: address)
    heartbeat: float = 0.1
    election_timeout: tuple[float, float] = (0.75, 1.5)
    leader_fallback: float = 1.875             # a leader without a majority steps down after this
    compaction_entries: int = 2000             # a snapshot after this many entries
    read_confirm: bool = True                  # ReadIndex's confirmation round (False: tests only, UNSAFE)
    read_lease: bool = False                   # leader leases: most reads skip the confirmation round
    # A non-voting learner (docs/design/elastic.md, "Moving a replica"): it receives the group's
    # snapshot and log from the leader and applies them into ``data_dir`` but never votes, never
    # counts toward a majority and is in no member's configuration (pysyncobj's read-only node).
    # A voter started later on the same ``data_dir`` and ``address`` goes on from what it kept.
    learner: bool = False
    # The replica's durability (raft/durability.py), shared with its payload store: with "fsync"
    # the log, term and vote are fsynced before they count (a follower's acknowledgement, the
    # leader's own vote in the commit count, a granted vote), and snapshots before they replace
    # the log; its file layer is the payloads', so a simulated disk logs all of a node's files in
    # one order. Default: "none", never fsynced.
    durability: Durability = field(default_factory=Durability)


@dataclass
class RaftStatus:
    role: str                                  # "leader" | "follower" | "candidate"
    term: int
    commit: int
    applied: int
    log_len: int
    has_quorum: bool
    leader: str | None                         # the leader's Raft address, if known
    match: dict[str, int] = field(default_factory=dict)       # leader: each peer's match index
    connected: dict[str, int] = field(default_factory=dict)   # each peer: 1 when connected
    read_rounds: int = 0                       # ReadIndex confirmation rounds completed
    lease_reads: int = 0                       # reads served on the leader's lease, without a round
    votes_withheld: int = 0                    # vote requests refused under a lease promise


class ReplicatedLog(ABC):
    """A Raft log that orders opaque entries and applies them through an ``Applier``."""
    address: str

    @abstractmethod
    def propose(self, entry: bytes, done: Callable[[Any, NotApplied | None], None]) -> None:
        """Append ``entry`` (on the leader); ``done(result, None)`` runs in the log's thread right
        after it is applied, or ``done(None, NotApplied)`` if it will not be (or may not be)."""

    @abstractmethod
    def read_index(self, run: Callable[[], Any], timeout: float) -> Any:
        """Linearizable read without a log entry (Raft's ReadIndex): run ``run()`` in the log's
        thread once this member, still leader, has applied every entry committed before the call.
        Raises NotApplied(applied=False) when it cannot prove that in ``timeout``."""

    def lease_read_index(self) -> int | None:
        """Any thread: the read index for a read served on the leader's lease right now, or None
        (no lease; use ``read_index``). A state that has applied through it includes every write
        that completed before the call. Optional: logs without leases keep this default."""
        return None

    @abstractmethod
    def is_leader(self) -> bool: ...

    @abstractmethod
    def leader(self) -> str | None:
        """The leader's Raft address as this member knows it."""

    @abstractmethod
    def others(self) -> list[str]:
        """Every other member's Raft address (membership changes move it)."""

    @abstractmethod
    def status(self) -> RaftStatus: ...

    @property
    @abstractmethod
    def applied_index(self) -> int: ...

    @property
    @abstractmethod
    def commit_index(self) -> int: ...

    @abstractmethod
    def compact(self) -> None:
        """Take a snapshot soon (``Applier.save_snapshot``) and drop the log it covers."""

    @abstractmethod
    def install(self, meta_index: int, restore: Callable[[], None]) -> None:
        """In the log's thread: if ``meta_index`` is past what is applied, run ``restore()`` (which
        replaces the state by a snapshot through ``meta_index``) and mark it applied. The log
        itself is untouched. For an entry whose payload is gone from every member."""

    @abstractmethod
    def wake(self) -> None:
        """Run the log's loop now (an entry that was NotReady may be ready)."""

    @abstractmethod
    def change_members(self, action: str, address: str, done: Callable[[bool, str], None]) -> None:
        """Add ("add") or remove ("remove") one member, one change at a time; ``done(ok, why)``."""

    @abstractmethod
    def transfer_leadership(self, timeout: float, to: str | None = None) -> None:
        """Hand leadership to member ``to`` (None: the most caught-up one) if it is caught up;
        returns once this one is not leader (or at the timeout, leadership kept)."""

    @abstractmethod
    def is_connected(self, address: str) -> bool: ...

    @abstractmethod
    def alive(self) -> bool:
        """False once the log's thread has died (the process should exit and be restarted)."""

    @abstractmethod
    def stop(self) -> None: ...


def saved_hook(applier: Applier) -> Callable[[SnapshotMeta], None]:
    """The applier's optional ``snapshot_saved``, or a no-op."""
    return getattr(applier, "snapshot_saved", None) or (lambda meta: None)
