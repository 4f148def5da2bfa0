"""cgpud's persistent state: the instance tables and run-time node settings in
one SQLite file (by default `<state_dir>/cgpud.db`).

Crash safety (ARCHITECTURE rule 4): every change is one SQLite transaction
taken with BEGIN IMMEDIATE and committed in WAL mode, so a commit that
returned survives `kill -9` of the daemon, and a transaction that did not
commit leaves no trace. Instance changes commit with synchronous=NORMAL: a
power loss may forget the last of them, but it also reboots the host, and
reconcile releases every instance of an earlier boot, so forgetting changes
nothing while sparing an fsync on every container start and stop. Node
settings outlive reboots and commit with synchronous=FULL. An instance and its grants
are written in the same transaction, so no reader ever sees one without the
other.

Admission must read the active instances, decide, and insert without another
request slipping in between; `Store.transaction()` gives exactly that: one
write transaction with the read and write methods of `Transaction`. The
convenience methods on `Store` (`get`, `insert`, `set_state`, ...) are each a
one-call transaction over the same `Transaction` methods, so the SQL lives in
one place.

Thread-safety: a Store owns one connection (opened with
check_same_thread=False) and serialises every transaction on a lock, so any
number of threads (the gRPC thread pool) may share it. A `Transaction`
belongs to the thread that opened it and only lives inside its `with` block;
opening a second transaction on the same thread while one is open is refused
rather than deadlocking. Another process that opens the file waits up to
BUSY_TIMEOUT for a writer to finish."""

from __future__ import annotations

import builtins
import functools
import json
import os
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

import structlog

from cgpud.node.model import ACTIVE_STATES, Grant, Instance, InstanceState, Owner, OwnerKind, Reservation, Share
from cgpud.errors import CgpuError, NotFoundError, StateError, UsageError

_P = ParamSpec("_P")
_R = TypeVar("_R")

SCHEMA_VERSION = 4
SCHEMA_KEY = "schema_version"  # in `meta`; reserved, not a setting
DB_MODE = 0o600  # instance tables are root's business only
DIR_MODE = 0o700
BUSY_TIMEOUT = 10.0  # seconds another process's write may hold us up
ID_PREFIX = "cgpu-"

# Allowed state changes. bound -> bound is how pids of a running owner are
# updated; released is final (it is history, its resources are free again).
_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.RESERVED: frozenset({InstanceState.BOUND, InstanceState.RELEASED}),
    # bound -> reserved: a claimed instance handed back when its container stops.
    InstanceState.BOUND: frozenset({InstanceState.RESERVED, InstanceState.BOUND, InstanceState.RELEASED}),
    InstanceState.RELEASED: frozenset(),
}

_SCHEMA = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE instances (
    id         TEXT PRIMARY KEY,
    owner_kind TEXT NOT NULL,
    owner_id   TEXT NOT NULL,
    state      TEXT NOT NULL CHECK (state IN ('reserved', 'bound', 'released')),
    enforced   INTEGER NOT NULL CHECK (enforced IN (0, 1)),
    weight     INTEGER NOT NULL,
    priority   INTEGER NOT NULL,
    pids       TEXT NOT NULL DEFAULT '[]',
    boot_id    TEXT NOT NULL DEFAULT '',
    created    REAL NOT NULL,
    updated    REAL NOT NULL,
    holder     TEXT NOT NULL DEFAULT ''
);
-- active() and list() filter on state and sort by (created, id).
CREATE INDEX instances_by_state ON instances (state, created, id);
CREATE TABLE grants (
    instance_id  TEXT NOT NULL REFERENCES instances (id) ON DELETE CASCADE,
    gpu_index    INTEGER NOT NULL,
    gpu_uuid     TEXT NOT NULL,
    memory       INTEGER NOT NULL CHECK (memory >= 0),
    core_percent INTEGER NOT NULL CHECK (core_percent BETWEEN 0 AND 100),
    PRIMARY KEY (instance_id, gpu_index)
);
CREATE TABLE reservations (
    pod_uid   TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    name      TEXT NOT NULL,
    shares    TEXT NOT NULL,
    expires   REAL NOT NULL
);
CREATE TABLE runtime_users (
    instance_id TEXT NOT NULL REFERENCES instances (id) ON DELETE CASCADE,
    version     TEXT NOT NULL,
    PRIMARY KEY (instance_id, version)
);
"""

_INSTANCE_COLUMNS = (
    "id, owner_kind, owner_id, state, enforced, weight, priority, pids, boot_id, created, updated, holder"
)
# Version -> statements that bring the previous version's file up to it.
# Version 2: `holder`, the container a claimed instance is bound to, so that
# only that container's poststop hands it back.
# Version 3: `reservations`, capacity a cluster scheduler holds for a pod
# it is binding here (the Capacity API's Reserve).
# Version 4: `runtime_users`, the runtime file versions whose paths each
# instance's edits named (runtime_files.py). Instances from before it may
# use the unversioned files: they are recorded under LEGACY_RUNTIME.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE instances ADD COLUMN holder TEXT NOT NULL DEFAULT ''",),
    3: (
        """CREATE TABLE reservations (
    pod_uid   TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    name      TEXT NOT NULL,
    shares    TEXT NOT NULL,
    expires   REAL NOT NULL
)""",
    ),
    4: (
        """CREATE TABLE runtime_users (
    instance_id TEXT NOT NULL REFERENCES instances (id) ON DELETE CASCADE,
    version     TEXT NOT NULL,
    PRIMARY KEY (instance_id, version)
)""",
        "INSERT INTO runtime_users (instance_id, version) SELECT id, '' FROM instances WHERE state != 'released'",
    ),
}
LEGACY_RUNTIME = ""  # runtime_users.version of the files in <state_dir>/runtime/ itself


def new_instance_id() -> str:
    """A fresh instance id: "cgpu-" and 12 random hex digits (48 bits, so a
    node never sees a collision in practice; insert still refuses one)."""
    return ID_PREFIX + secrets.token_hex(6)


def _state_error(instance_id: str, current: InstanceState, new: InstanceState) -> StateError:
    again = " again" if current is new else ""
    return StateError(f"instance {instance_id} is {current.value}; it cannot be {new.value}{again}")


def _as_states(expect: InstanceState | Iterable[InstanceState]) -> frozenset[InstanceState]:
    if isinstance(expect, InstanceState):
        return frozenset({expect})
    return frozenset(expect)


def _check_pids(pids: Iterable[int]) -> tuple[int, ...]:
    out = tuple(pids)
    for pid in out:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise UsageError(f"pid {pid!r} is not a positive integer")
    return out


class _DecodedRows:
    """Reservations decoded from their rows, found by the row itself (a
    row's every column is in the key: a changed row is a new key). Every
    admission and every node view reads all the reservations, and decoding
    each (JSON, checks) was most of cgpud's CPU per Reserve with 40 held.
    Touched only inside a transaction, under the store's lock."""

    def __init__(self, size: int = 4096) -> None:
        self._rows: dict[tuple[object, ...], Reservation] = {}
        self._size = size

    def get(self, row: tuple[object, ...]) -> Reservation:
        hit = self._rows.get(row)
        if hit is None:
            hit = _reservation(row)  # raises for an unreadable row, which is not kept
            if len(self._rows) >= self._size:
                self._rows.clear()
            self._rows[row] = hit
        return hit


@dataclass(eq=False)
class Transaction:
    """Reads and writes inside one SQLite transaction. Obtain it from
    `Store.transaction()`; it is dead once its `with` block ends."""

    _conn: sqlite3.Connection
    _clock: Callable[[], float]
    _writable: bool
    _thread: int
    _open: bool = True
    _decoded: _DecodedRows = field(default_factory=_DecodedRows)

    def _db(self, *, write: bool = False) -> sqlite3.Connection:
        # A Transaction leaking out of its block, or handed to another thread,
        # would run SQL outside the transaction and the lock: refuse it.
        if not self._open:
            raise CgpuError("this store transaction has ended; open a new one")
        if threading.get_ident() != self._thread:
            raise CgpuError("a store transaction was used from another thread than its own")
        if write and not self._writable:
            raise CgpuError("a write was attempted in a read-only store transaction")
        return self._conn

    # ---------------------------------------------------------------- reads

    def get(self, instance_id: str) -> Instance:
        """The instance with this id, in any state; NotFoundError if none."""
        found = self._select("WHERE id = ?", (instance_id,))
        if not found:
            raise NotFoundError(f"no instance {instance_id}")
        return found[0]

    def list(self, include_released: bool = False) -> builtins.list[Instance]:
        """Instances ordered by creation time then id; released ones only if asked."""
        if include_released:
            return self._select("", ())
        return self.active()

    def active(self) -> builtins.list[Instance]:
        """Reserved and bound instances, ordered by creation time then id:
        the ones that hold GPU resources."""
        marks = ", ".join("?" * len(ACTIVE_STATES))
        return self._select(f"WHERE state IN ({marks})", tuple(s.value for s in ACTIVE_STATES))

    def reservations(self) -> builtins.list[Reservation]:
        """Every stored reservation, expired ones included (the caller has
        the clock), ordered by pod UID. A row that cannot be read (a damaged
        file) is skipped and logged: one bad row must not stop admission."""
        rows = (
            self._db()
            .execute("SELECT pod_uid, namespace, name, shares, expires FROM reservations ORDER BY pod_uid")
            .fetchall()
        )
        out = []
        for row in rows:
            try:
                out.append(self._decoded.get(tuple(row)))
            except (ValueError, TypeError, KeyError) as e:
                structlog.get_logger("cgpud.store").error(
                    "unreadable reservation skipped", pod_uid=str(row[0]), error=str(e)
                )
        return out

    def holdings(self) -> tuple[builtins.list[Instance], builtins.list[Reservation]]:
        """The active instances and every stored reservation, read in one
        snapshot: a create that drew on a reservation is seen in both or in
        neither."""
        return self.active(), self.reservations()

    def get_setting(self, key: str) -> str | None:
        """A node setting stored at run time (e.g. the compute policy), or None."""
        self._check_key(key)
        row = self._db().execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    # --------------------------------------------------------------- writes

    def insert(self, instance: Instance) -> Instance:
        """Store a new instance with its grants. Zero `created`/`updated` are
        stamped with the current time; the instance as stored is returned.
        Refuses an id already present (in any state) and a GPU listed twice."""
        db = self._db(write=True)
        if not instance.id:
            raise UsageError("an instance needs a non-empty id")
        indexes = [g.gpu_index for g in instance.grants]
        if len(set(indexes)) != len(indexes):
            raise UsageError(f"instance {instance.id} lists a GPU twice: indexes {indexes}")
        pids = _check_pids(instance.pids)
        try:
            kind, state = OwnerKind(instance.owner.kind), InstanceState(instance.state)
        except ValueError as e:
            raise UsageError(f"instance {instance.id}: {e}") from e
        for g in instance.grants:
            if g.memory < 0 or not 0 <= g.core_percent <= 100:
                raise UsageError(
                    f"instance {instance.id}: GPU {g.gpu_index} grant of {g.memory} bytes and"
                    f" {g.core_percent}% compute is out of range (memory >= 0, compute 0..100)"
                )
        # We hold the write lock (BEGIN IMMEDIATE), so this check cannot race.
        if db.execute("SELECT 1 FROM instances WHERE id = ?", (instance.id,)).fetchone():
            raise CgpuError(f"instance {instance.id} already exists")
        now = self._clock()
        created = instance.created or now
        stored = replace(
            instance,
            owner=Owner(kind, instance.owner.id),
            state=state,
            enforced=bool(instance.enforced),
            pids=pids,
            created=created,
            updated=instance.updated or created,
        )
        db.execute(
            f"INSERT INTO instances ({_INSTANCE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                stored.id,
                kind.value,
                stored.owner.id,
                state.value,
                int(stored.enforced),
                stored.weight,
                stored.priority,
                json.dumps(list(stored.pids)),
                stored.boot_id,
                stored.created,
                stored.updated,
                stored.holder,
            ),
        )
        db.executemany(
            "INSERT INTO grants (instance_id, gpu_index, gpu_uuid, memory, core_percent) VALUES (?, ?, ?, ?, ?)",
            [(stored.id, g.gpu_index, g.gpu_uuid, g.memory, g.core_percent) for g in stored.grants],
        )
        return stored

    def set_state(
        self,
        instance_id: str,
        new_state: InstanceState,
        *,
        pids: Iterable[int] | None = None,
        owner_id: str | None = None,
        holder: str | None = None,
        expect: InstanceState | Iterable[InstanceState] | None = None,
        current: Instance | None = None,
    ) -> Instance:
        """Move an instance along reserved -> bound -> released (or reserved ->
        released; bound -> bound updates pids; bound -> reserved hands a claimed
        instance back). `pids`, `owner_id` and `holder` replace
        the stored ones when given. `expect` makes it a compare-and-set: the
        current state must be one of those. `current`: the instance as this
        transaction read it already, which saves reading it again. Returns
        the instance as stored."""
        db = self._db(write=True)
        try:
            new_state = InstanceState(new_state)
        except ValueError as e:
            raise UsageError(f"instance {instance_id}: {e}") from e
        if current is None or current.id != instance_id:
            current = self.get(instance_id)
        if new_state not in _TRANSITIONS[current.state]:
            raise _state_error(instance_id, current.state, new_state)
        if expect is not None:
            wanted = _as_states(expect)
            if current.state not in wanted:
                names = " or ".join(sorted(s.value for s in wanted))
                raise StateError(f"instance {instance_id} is {current.state.value}, not {names} as expected")
        changed = replace(
            current,
            state=new_state,
            pids=current.pids if pids is None else _check_pids(pids),
            owner=current.owner if owner_id is None else Owner(current.owner.kind, owner_id),
            holder=current.holder if holder is None else holder,
            updated=self._clock(),
        )
        db.execute(
            "UPDATE instances SET state = ?, pids = ?, owner_id = ?, holder = ?, updated = ? WHERE id = ?",
            (
                changed.state.value,
                json.dumps(list(changed.pids)),
                changed.owner.id,
                changed.holder,
                changed.updated,
                instance_id,
            ),
        )
        return changed

    def set_grants(self, instance: Instance, grants: Sequence[Grant]) -> Instance:
        """A resize: new memory and compute for the GPUs `instance` holds
        (the same GPUs, each once). Returns the instance as stored."""
        db = self._db(write=True)
        if sorted(g.gpu_index for g in grants) != sorted(g.gpu_index for g in instance.grants):
            raise UsageError(f"instance {instance.id}: a resize keeps its GPUs")
        for g in grants:
            if g.memory < 0 or not 0 <= g.core_percent <= 100:
                raise UsageError(
                    f"instance {instance.id}: GPU {g.gpu_index} grant of {g.memory} bytes and"
                    f" {g.core_percent}% compute is out of range (memory >= 0, compute 0..100)"
                )
        changed = replace(instance, grants=tuple(grants), updated=self._clock())
        db.executemany(
            "UPDATE grants SET memory = ?, core_percent = ? WHERE instance_id = ? AND gpu_index = ?",
            [(g.memory, g.core_percent, instance.id, g.gpu_index) for g in grants],
        )
        db.execute("UPDATE instances SET updated = ? WHERE id = ?", (changed.updated, instance.id))
        return changed

    def set_setting(self, key: str, value: str) -> None:
        """Store a node setting; it survives restarts."""
        self._check_key(key)
        if not isinstance(value, str):
            raise UsageError(f"setting {key!r} must be a string, not {type(value).__name__}")
        self._db(write=True).execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def put_reservation(self, reservation: Reservation) -> Reservation:
        """Store a reservation, replacing the same pod's."""
        db = self._db(write=True)
        if not reservation.pod_uid:
            raise UsageError("a reservation needs a pod UID")
        shares = json.dumps(
            [
                {"gpu_index": s.gpu_index, "memory": s.memory, "core_percent": s.core_percent, "instances": s.instances}
                for s in reservation.shares
            ]
        )
        db.execute(
            "INSERT INTO reservations (pod_uid, namespace, name, shares, expires) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (pod_uid) DO UPDATE SET namespace = excluded.namespace, name = excluded.name,"
            " shares = excluded.shares, expires = excluded.expires",
            (reservation.pod_uid, reservation.pod_namespace, reservation.pod_name, shares, float(reservation.expires)),
        )
        return reservation

    def delete_reservation(self, pod_uid: str) -> bool:
        """Delete a pod's reservation; False when it had none."""
        cur = self._db(write=True).execute("DELETE FROM reservations WHERE pod_uid = ?", (pod_uid,))
        return cur.rowcount > 0

    def delete_expired_reservations(self, now: float) -> builtins.list[str]:
        """Delete the reservations expired at `now`; their pod UIDs."""
        db = self._db(write=True)
        gone = [str(r[0]) for r in db.execute("SELECT pod_uid FROM reservations WHERE expires <= ?", (now,))]
        db.execute("DELETE FROM reservations WHERE expires <= ?", (now,))
        return gone

    def runtime_versions_in_use(self) -> set[str]:
        """The runtime versions some active instance's edits named."""
        marks = ", ".join("?" * len(ACTIVE_STATES))
        rows = self._db().execute(
            f"SELECT DISTINCT u.version FROM runtime_users u JOIN instances i ON i.id = u.instance_id "
            f"WHERE i.state IN ({marks})",
            tuple(s.value for s in ACTIVE_STATES),
        )
        return {str(r[0]) for r in rows}

    def add_runtime_users(self, instance_ids: Iterable[str], version: str) -> None:
        """Records that these instances' edits name `version`'s files, before
        the edits leave cgpud: its directory then stays while they are active."""
        self._db(write=True).executemany(
            "INSERT OR IGNORE INTO runtime_users (instance_id, version) SELECT id, ? FROM instances WHERE id = ?",
            [(version, i) for i in instance_ids],
        )

    def purge_released(self, older_than: float) -> int:
        """Delete released instances last changed before `older_than` (Unix
        seconds) with their grants; returns how many were deleted."""
        cur = self._db(write=True).execute(
            "DELETE FROM instances WHERE state = ? AND updated < ?",
            (InstanceState.RELEASED.value, older_than),
        )
        return cur.rowcount

    # -------------------------------------------------------------- helpers

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise UsageError(f"a setting key must be a non-empty string, not {key!r}")
        if key == SCHEMA_KEY:
            raise UsageError(f"{SCHEMA_KEY!r} is reserved by the store; it is not a setting")

    def _select(self, where: str, params: tuple[object, ...]) -> builtins.list[Instance]:
        # `where` is always a literal from this class; values go through params.
        # Two queries in one snapshot rather than one per instance.
        db = self._db()
        rows = db.execute(f"SELECT {_INSTANCE_COLUMNS} FROM instances {where} ORDER BY created, id", params).fetchall()
        if not rows:
            return []
        grants: dict[str, builtins.list[Grant]] = {row[0]: [] for row in rows}
        for iid, index, uuid, memory, core in db.execute(
            "SELECT instance_id, gpu_index, gpu_uuid, memory, core_percent FROM grants"
            f" WHERE instance_id IN (SELECT id FROM instances {where})"
            " ORDER BY instance_id, gpu_index",
            params,
        ):
            grants[iid].append(Grant(index, uuid, memory, core))
        return [self._instance(row, grants[row[0]]) for row in rows]

    @staticmethod
    def _instance(row: tuple[object, ...], grants: builtins.list[Grant]) -> Instance:
        iid, kind, owner_id, state, enforced, weight, priority, pids, boot_id, created, updated, holder = row
        try:
            return Instance(
                id=str(iid),
                owner=Owner(OwnerKind(kind), str(owner_id)),
                grants=tuple(grants),
                state=InstanceState(state),
                enforced=bool(enforced),
                weight=int(weight),  # type: ignore[call-overload]
                priority=int(priority),  # type: ignore[call-overload]
                pids=tuple(int(p) for p in json.loads(str(pids))),
                boot_id=str(boot_id),
                created=float(created),  # type: ignore[arg-type]
                updated=float(updated),  # type: ignore[arg-type]
                holder=str(holder),
            )
        except (ValueError, TypeError) as e:
            raise CgpuError(f"instance {iid} in the state database is unreadable: {e}") from e


def _reservation(row: tuple[object, ...]) -> Reservation:
    pod_uid, namespace, name, shares, expires = row
    items = json.loads(str(shares))
    if not isinstance(items, builtins.list):
        raise ValueError("shares is not a list")
    parsed = []
    for item in items:
        values = [item[k] for k in ("gpu_index", "memory", "core_percent", "instances")]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"share {item!r} holds a value that is not an integer")
        parsed.append(Share(*values))
    shares = tuple(sorted(parsed, key=lambda s: s.gpu_index))
    return Reservation(str(pod_uid), str(namespace), str(name), shares, float(expires))  # type: ignore[arg-type]


def _one_call(
    method: Callable[Concatenate[Transaction, _P], _R], *, write: bool
) -> Callable[Concatenate[Store, _P], _R]:
    """A Store method running one Transaction method in a transaction of its own."""

    @functools.wraps(method)
    def call(store: Store, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with store._transaction(write=write) as tx:
            return method(tx, *args, **kwargs)

    return call


@dataclass(frozen=True)
class _Holdings:
    """The active instances and the reservations as read at `key`: (this
    store's count of write transactions, SQLite's data_version, which
    moves when another connection commits)."""

    key: tuple[int, int]
    active: tuple[Instance, ...]
    reservations: tuple[Reservation, ...]


class Store:
    """The SQLite file holding cgpud's instance tables and run-time settings.
    See the module docstring for crash safety and thread-safety.

    The active instances and the reservations are read again only when a
    write committed since the last read, through this store or any other
    connection: the watchdog, the sweep, the metrics and every admission
    read them, and most of those reads find nothing changed."""

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self._clock = clock
        # Re-entrant only so that a nested transaction on the same thread is
        # detected and refused instead of deadlocking.
        self._lock = threading.RLock()
        self._in_transaction = False
        self._conn: sqlite3.Connection | None = None
        self._decoded = _DecodedRows()
        self._writes = 0  # write transactions begun on this store, committed or not
        self._holdings: _Holdings | None = None
        self._create_file()
        try:
            self._conn = self._connect()
            self._migrate()
        except sqlite3.Error as e:
            self.close()
            raise CgpuError(f"state database {self.path} cannot be opened: {e}") from e
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------- lifecycle

    def _create_file(self) -> None:
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, mode=DIR_MODE)
            os.chmod(parent, DIR_MODE)  # mkdir's mode is masked by the umask
        # Create the file ourselves so it never exists with a wider mode, and
        # refuse to follow a symlink planted in its place. SQLite gives the
        # -wal and -shm files the database file's mode.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, DB_MODE)
        except OSError as e:
            raise CgpuError(f"state database {self.path} cannot be opened: {e.strerror}") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CgpuError(f"state database {self.path} is not a regular file")
            os.fchmod(fd, DB_MODE)
            created = os.fstat(fd).st_size == 0
        finally:
            os.close(fd)
        if created:
            # Make the new directory entry itself durable.
            dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, never the
        # sqlite3 module's implicit transactions.
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise CgpuError(
                    f"state database {self.path} cannot use WAL journaling (got {mode!r});"
                    " put the state directory on a local filesystem"
                )
            # NORMAL: a commit survives kill -9, and a power loss may forget
            # the last instance changes (see above); node settings switch to
            # FULL for their own commit.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT * 1000)}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self) -> None:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
            if not has_meta:
                if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                    raise CgpuError(
                        f"{self.path} holds tables but no cgpud schema; it is not a cgpud"
                        " state database: move it away or pass another path"
                    )
                # executescript would COMMIT first; run statements one by one
                # so the schema and its version land in one transaction.
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (SCHEMA_KEY, str(SCHEMA_VERSION)))
            else:
                row = conn.execute("SELECT value FROM meta WHERE key = ?", (SCHEMA_KEY,)).fetchone()
                try:
                    version = int(row[0]) if row else 0
                except ValueError:
                    version = 0
                if version > SCHEMA_VERSION:
                    raise CgpuError(
                        f"state database {self.path} has schema version {version}, written by a"
                        f" newer cgpud; this one knows up to version {SCHEMA_VERSION}:"
                        " upgrade cgpud (do not downgrade over existing state)"
                    )
                if 1 <= version < SCHEMA_VERSION:
                    for step in range(version + 1, SCHEMA_VERSION + 1):
                        for statement in _MIGRATIONS[step]:
                            conn.execute(statement)
                    conn.execute("UPDATE meta SET value = ? WHERE key = ?", (str(SCHEMA_VERSION), SCHEMA_KEY))
                elif version != SCHEMA_VERSION:
                    raise CgpuError(
                        f"state database {self.path} has no valid schema version"
                        f" ({row[0] if row else 'missing'!r}); it is damaged or not cgpud's:"
                        " move it away to start with empty state"
                    )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close the connection; committed state is already durable."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise CgpuError(f"state database {self.path} is closed")
        return self._conn

    # ---------------------------------------------------------- transactions

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """One write transaction (BEGIN IMMEDIATE): everything done through
        the yielded Transaction commits together when the block ends, or not
        at all if it raises. Other threads wait; hold it briefly."""
        with self._transaction(write=True) as tx:
            yield tx

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[Transaction]:
        with self._lock:
            if self._in_transaction:
                raise CgpuError("a store transaction is already open on this thread")
            conn = self._connection()
            # Reads take a deferred transaction: a consistent snapshot of an
            # instance and its grants without blocking writers.
            begin = "BEGIN IMMEDIATE" if write else "BEGIN DEFERRED"
            tx = Transaction(conn, self._clock, write, threading.get_ident(), _decoded=self._decoded)
            self._in_transaction = True
            if write:
                self._writes += 1  # before it begins: no read may keep a key that predates it
            try:
                try:
                    conn.execute(begin)
                    yield tx
                    tx._open = False
                    conn.execute("COMMIT")
                except BaseException:
                    tx._open = False
                    # SQLite may already have rolled back (e.g. after an I/O
                    # error); ROLLBACK outside a transaction would fail.
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise CgpuError(f"state database {self.path}: {e}") from e
            finally:
                self._in_transaction = False

    # ------------------------------------------------- one-call transactions

    def active(self) -> builtins.list[Instance]:
        return builtins.list(self._read_holdings().active)

    active.__doc__ = Transaction.active.__doc__

    def holdings(self) -> tuple[builtins.list[Instance], builtins.list[Reservation]]:
        held = self._read_holdings()
        return builtins.list(held.active), builtins.list(held.reservations)

    holdings.__doc__ = Transaction.holdings.__doc__

    def _read_holdings(self) -> _Holdings:
        with self._lock:
            if self._in_transaction:
                raise CgpuError("a store transaction is already open on this thread")
            try:
                version = int(self._connection().execute("PRAGMA data_version").fetchone()[0])
            except sqlite3.Error as e:
                raise CgpuError(f"state database {self.path}: {e}") from e
            key = (self._writes, version)
            if self._holdings is None or self._holdings.key != key:
                # Keyed by what was true before the read: a commit by another
                # connection during it only makes the next read look again.
                with self._transaction(write=False) as tx:
                    active, reserved = tx.holdings()
                self._holdings = _Holdings(key, tuple(active), tuple(reserved))
            return self._holdings

    get = _one_call(Transaction.get, write=False)
    list = _one_call(Transaction.list, write=False)
    get_setting = _one_call(Transaction.get_setting, write=False)
    insert = _one_call(Transaction.insert, write=True)
    set_state = _one_call(Transaction.set_state, write=True)
    set_grants = _one_call(Transaction.set_grants, write=True)
    purge_released = _one_call(Transaction.purge_released, write=True)
    runtime_versions_in_use = _one_call(Transaction.runtime_versions_in_use, write=False)
    add_runtime_users = _one_call(Transaction.add_runtime_users, write=True)
    reservations = _one_call(Transaction.reservations, write=False)
    put_reservation = _one_call(Transaction.put_reservation, write=True)
    delete_reservation = _one_call(Transaction.delete_reservation, write=True)
    delete_expired_reservations = _one_call(Transaction.delete_expired_reservations, write=True)

    def set_setting(self, key: str, value: str) -> None:
        with self._lock:
            conn = self._connection()
            conn.execute("PRAGMA synchronous=FULL")
            try:
                with self.transaction() as tx:
                    tx.set_setting(key, value)
            finally:
                conn.execute("PRAGMA synchronous=NORMAL")

    set_setting.__doc__ = Transaction.set_setting.__doc__
