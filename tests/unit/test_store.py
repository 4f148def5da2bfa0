"""The SQLite store as cgpud uses it: real database files in tmp_path, real
threads, and a real writer process killed with SIGKILL mid-stream."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from cgpud.node.model import GIB, Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.node.store import SCHEMA_VERSION, Store, new_instance_id
from cgpud.errors import CgpuError, NotFoundError, StateError, UsageError
from tests.harness.threads import run_threads

REPO = Path(__file__).resolve().parents[2]
RESERVED, BOUND, RELEASED = InstanceState.RESERVED, InstanceState.BOUND, InstanceState.RELEASED


def make(
    state: InstanceState = RESERVED,
    gpus: int = 1,
    *,
    created: float = 0.0,
    iid: str | None = None,
) -> Instance:
    return Instance(
        id=iid or new_instance_id(),
        owner=Owner(OwnerKind.CONTAINER, "c-" + new_instance_id()),
        grants=tuple(Grant(i, f"GPU-{i:04d}", (i + 1) * GIB, 10 * i) for i in range(gpus)),
        state=state,
        enforced=True,
        created=created,
    )


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "cgpud.db"


@pytest.fixture
def store(db: Path) -> Iterator[Store]:
    s = Store(db)
    yield s
    s.close()


def raw(db: Path) -> sqlite3.Connection:
    """A second, independent connection to look at what is really on disk."""
    return sqlite3.connect(db, isolation_level=None)


# ------------------------------------------------------------ basics


def test_roundtrip_of_every_field(store: Store, db: Path) -> None:
    inst = Instance(
        id="cgpu-0123456789ab",
        owner=Owner(OwnerKind.POD, "8f1c2d3e-pod-uid"),
        grants=(Grant(0, "GPU-aaaa", 3 * GIB, 25), Grant(3, "GPU-dddd", 5 * GIB + 7, 0)),
        state=BOUND,
        enforced=False,
        weight=3,
        priority=-2,
        pids=(101, 202, 303),
        boot_id="boot-42",
        created=1700000000.25,
        updated=1700000001.5,
    )
    assert store.insert(inst) == inst
    assert store.get(inst.id) == inst
    store.close()
    with Store(db) as again:  # and from disk, not from anything cached
        got = again.get(inst.id)
    assert got == inst
    assert isinstance(got.owner.kind, OwnerKind) and isinstance(got.state, InstanceState)
    assert got.grants[1].memory == 5 * GIB + 7


def test_insert_stamps_zero_times(db: Path) -> None:
    with Store(db, clock=lambda: 1234.5) as s:
        got = s.insert(make())
        assert (got.created, got.updated) == (1234.5, 1234.5)
        assert s.get(got.id) == got


def test_new_instance_id_shape() -> None:
    ids = {new_instance_id() for _ in range(1000)}
    assert len(ids) == 1000
    for i in ids:
        assert i.startswith("cgpu-") and len(i) == 17 and int(i[5:], 16) >= 0


def test_list_order_and_active(store: Store) -> None:
    # Same creation time for b and c: the id breaks the tie.
    a = store.insert(make(created=10.0, iid="cgpu-00000000000a"))
    c = store.insert(make(created=20.0, iid="cgpu-00000000000c"))
    b = store.insert(make(created=20.0, iid="cgpu-00000000000b"))
    d = store.insert(make(created=5.0, iid="cgpu-00000000000d"))
    store.set_state(a.id, BOUND, pids=[7])
    store.set_state(d.id, RELEASED)
    assert [i.id for i in store.list()] == [a.id, b.id, c.id]
    assert [i.id for i in store.active()] == [a.id, b.id, c.id]
    assert [i.id for i in store.list(include_released=True)] == [d.id, a.id, b.id, c.id]
    assert all(len(i.grants) == 1 for i in store.list(include_released=True))


def test_unknown_id(store: Store) -> None:
    with pytest.raises(NotFoundError, match="no instance cgpu-nope"):
        store.get("cgpu-nope")
    with pytest.raises(NotFoundError, match="no instance cgpu-nope"):
        store.set_state("cgpu-nope", BOUND)


def test_duplicate_id_and_gpu_refused_and_change_nothing(store: Store) -> None:
    first = store.insert(make(gpus=2))
    with pytest.raises(CgpuError, match=f"instance {first.id} already exists"):
        store.insert(make(iid=first.id, gpus=1))
    twice = make()
    twice = Instance(twice.id, twice.owner, (Grant(0, "GPU-a", 1, 0), Grant(0, "GPU-a", 1, 0)), RESERVED, True)
    with pytest.raises(UsageError, match="lists a GPU twice"):
        store.insert(twice)
    bad = make()
    bad = Instance(bad.id, bad.owner, (Grant(0, "GPU-a", 1, 101),), RESERVED, True)
    with pytest.raises(UsageError, match="out of range"):
        store.insert(bad)
    assert store.list(include_released=True) == [first]


# ------------------------------------------------------- transitions


@pytest.mark.parametrize(
    ("start", "new"),
    [(RESERVED, BOUND), (RESERVED, RELEASED), (BOUND, RELEASED), (BOUND, BOUND), (BOUND, RESERVED)],
)
def test_allowed_transitions(db: Path, start: InstanceState, new: InstanceState) -> None:
    now = [100.0]
    with Store(db, clock=lambda: now[0]) as s:
        inst = s.insert(make(start))
        now[0] = 200.0
        got = s.set_state(inst.id, new, pids=[11, 12], owner_id="ctr-new")
        assert got.state is new
        assert got.pids == (11, 12) and got.owner == Owner(OwnerKind.CONTAINER, "ctr-new")
        assert (got.created, got.updated) == (100.0, 200.0)
        assert s.get(inst.id) == got
        # Without pids or owner_id both stay as they are.
        if new is BOUND:
            assert s.set_state(inst.id, new).pids == (11, 12)


def test_bound_to_bound_updates_pids(store: Store) -> None:
    inst = store.insert(make())
    store.set_state(inst.id, BOUND, pids=[1])
    store.set_state(inst.id, BOUND, pids=[1, 2, 3])
    assert store.get(inst.id).pids == (1, 2, 3)


@pytest.mark.parametrize(
    ("path", "new", "message"),
    [
        ([RELEASED], BOUND, "is released; it cannot be bound$"),
        ([RELEASED], RELEASED, "is released; it cannot be released again$"),
        ([RELEASED], RESERVED, "is released; it cannot be reserved$"),
        ([BOUND, RELEASED], BOUND, "is released; it cannot be bound$"),
        ([], RESERVED, "is reserved; it cannot be reserved again$"),
    ],
)
def test_refused_transitions(store: Store, path: list[InstanceState], new: InstanceState, message: str) -> None:
    inst = store.insert(make())
    for step in path:
        store.set_state(inst.id, step)
    before = store.get(inst.id)
    with pytest.raises(StateError, match=f"^instance {inst.id} {message}"):
        store.set_state(inst.id, new, pids=[99])
    assert store.get(inst.id) == before


def test_expect_is_a_compare_and_set(store: Store) -> None:
    inst = store.insert(make())
    store.set_state(inst.id, BOUND, expect=RESERVED)
    with pytest.raises(StateError, match=f"instance {inst.id} is bound, not reserved as expected"):
        store.set_state(inst.id, RELEASED, expect=RESERVED)
    assert store.get(inst.id).state is BOUND
    store.set_state(inst.id, RELEASED, expect=(RESERVED, BOUND))
    assert store.get(inst.id).state is RELEASED


def test_bad_state_and_pids_are_usage_errors(store: Store) -> None:
    inst = store.insert(make())
    with pytest.raises(UsageError, match="bogus"):
        store.set_state(inst.id, "bogus")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="pid -1"):
        store.set_state(inst.id, BOUND, pids=[5, -1])
    assert store.get(inst.id).state is RESERVED


# ------------------------------------------------------- transactions


def test_transaction_commits_read_decide_insert(store: Store) -> None:
    with store.transaction() as tx:
        assert tx.active() == []
        a = tx.insert(make())
        assert [i.id for i in tx.active()] == [a.id]  # sees its own write
        tx.set_state(a.id, BOUND, pids=[3])
        tx.set_setting("compute_policy", "2")
    assert store.get(a.id).state is BOUND
    assert store.get_setting("compute_policy") == "2"


def test_transaction_rollback_on_exception_leaves_nothing(store: Store, db: Path) -> None:
    kept = store.insert(make())
    store.set_setting("compute_policy", "5")

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with store.transaction() as tx:
            tx.insert(make(gpus=3))
            tx.insert(make(gpus=2))
            tx.set_state(kept.id, RELEASED)
            tx.set_setting("compute_policy", "0")
            raise Boom()
    assert store.list(include_released=True) == [kept]
    assert store.get_setting("compute_policy") == "5"
    conn = raw(db)
    assert conn.execute("SELECT count(*) FROM instances").fetchone()[0] == 1
    assert conn.execute("SELECT count(*) FROM grants").fetchone()[0] == 1
    conn.close()
    # A failing write inside the block rolls back everything before it too.
    with pytest.raises(StateError):
        with store.transaction() as tx:
            tx.insert(make())
            tx.set_state(kept.id, RESERVED)
    assert store.list(include_released=True) == [kept]


def test_transaction_misuse_is_refused(store: Store) -> None:
    with store.transaction() as tx:
        with pytest.raises(CgpuError, match="already open on this thread"):
            store.get("x")
        errors: list[Exception] = []

        def other() -> None:
            try:
                tx.active()
            except CgpuError as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(errors) == 1 and "another thread" in str(errors[0])
    with pytest.raises(CgpuError, match="has ended"):
        tx.active()
    store.insert(make())  # and the store still works


def test_admission_in_one_transaction_is_atomic(store: Store) -> None:
    """8 threads each admit while fewer than 5 instances are active: the
    read-decide-insert in one transaction lets exactly 5 in."""
    start = threading.Barrier(8)
    admitted: list[bool] = []

    def admit() -> None:
        start.wait()
        with store.transaction() as tx:
            if len(tx.active()) < 5:
                time.sleep(0.01)  # widen the window a race would need
                tx.insert(make())
                admitted.append(True)
            else:
                admitted.append(False)

    run_threads(*[admit] * 8)
    assert len(admitted) == 8, "an admission thread failed"
    assert admitted.count(True) == 5 and len(store.active()) == 5


def test_concurrent_inserts_from_four_threads_all_land(store: Store, db: Path) -> None:
    start = threading.Barrier(4)
    ids: list[list[str]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            start.wait()
            for k in range(50):
                inst = store.insert(make(gpus=1 + k % 3))
                ids[n].append(inst.id)
                if k % 5 == 0:
                    store.set_state(inst.id, BOUND, pids=[n * 1000 + k + 1])
        except BaseException as e:
            errors.append(e)

    run_threads(*(partial(work, n) for n in range(4)))
    assert errors == []
    want = {i for chunk in ids for i in chunk}
    assert len(want) == 200
    store.close()
    with Store(db) as again:
        got = again.list()
        assert {i.id for i in got} == want
        assert sum(len(i.grants) for i in got) == sum(1 + k % 3 for k in range(50)) * 4


# ----------------------------------------------------- settings, purge


def test_settings(store: Store, db: Path) -> None:
    assert store.get_setting("compute_policy") is None
    store.set_setting("compute_policy", "2")
    store.set_setting("compute_policy", "3")
    assert store.get_setting("compute_policy") == "3"
    with pytest.raises(UsageError, match="reserved"):
        store.set_setting("schema_version", "9")
    with pytest.raises(UsageError, match="must be a string"):
        store.set_setting("compute_policy", 3)  # type: ignore[arg-type]
    store.close()
    with Store(db) as again:
        assert again.get_setting("compute_policy") == "3"


def test_purge_released_drops_old_history_and_its_grants(db: Path) -> None:
    now = [100.0]
    with Store(db, clock=lambda: now[0]) as s:
        old = s.insert(make(gpus=2))
        s.set_state(old.id, RELEASED)
        now[0] = 200.0
        recent = s.insert(make(gpus=2))
        s.set_state(recent.id, RELEASED)
        live = s.insert(make(gpus=2))
        assert s.purge_released(older_than=150.0) == 1
        # Both were created at 200.0; the id orders them.
        assert [i.id for i in s.list(include_released=True)] == sorted([recent.id, live.id])
        with pytest.raises(NotFoundError):
            s.get(old.id)
    conn = raw(db)
    assert conn.execute("SELECT count(*) FROM grants WHERE instance_id = ?", (old.id,)).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM grants").fetchone()[0] == 4
    conn.close()


# -------------------------------------------------- files and schema


def test_reopen_after_close_keeps_everything(db: Path) -> None:
    with Store(db) as s:
        made = [s.insert(make(gpus=1 + n % 4)) for n in range(20)]
        s.set_state(made[0].id, BOUND, pids=[1, 2])
        s.set_state(made[1].id, RELEASED)
        s.set_setting("compute_policy", "4")
        before = s.list(include_released=True)
    with Store(db) as s:
        assert s.list(include_released=True) == before
        assert s.get_setting("compute_policy") == "4"
    with pytest.raises(CgpuError, match="is closed"):
        s.get(made[0].id)


def test_file_and_directory_modes(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        db = tmp_path / "new" / "deeper" / "cgpud.db"
        with Store(db) as s:
            s.insert(make())
            assert stat.S_IMODE(db.stat().st_mode) == 0o600
            assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
            wal = db.with_name(db.name + "-wal")
            assert wal.exists() and stat.S_IMODE(wal.stat().st_mode) == 0o600
        loose = tmp_path / "loose.db"
        loose.touch(mode=0o644)
        os.chmod(loose, 0o644)
        Store(loose).close()
        assert stat.S_IMODE(loose.stat().st_mode) == 0o600  # tightened
    finally:
        os.umask(old)


def test_pragmas_on_disk(store: Store, db: Path) -> None:
    conn = raw(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    conn.close()


def test_symlink_in_place_of_the_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.db"
    link = tmp_path / "cgpud.db"
    link.symlink_to(target)
    with pytest.raises(CgpuError, match="cannot be opened"):
        Store(link)
    assert not target.exists()


def test_newer_schema_version_is_refused(db: Path) -> None:
    with Store(db) as s:
        s.insert(make())
    conn = raw(db)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.close()
    with pytest.raises(CgpuError, match=f"schema version {SCHEMA_VERSION + 1}, written by a newer cgpud"):
        Store(db)


@pytest.mark.parametrize("content", [b"this is not a database" * 100, "foreign"])
def test_foreign_files_are_refused(tmp_path: Path, content: bytes | str) -> None:
    path = tmp_path / "x.db"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        conn = raw(path)
        conn.execute("CREATE TABLE t (a)")
        conn.close()
    with pytest.raises(CgpuError, match=str(path)):
        Store(path)


# ------------------------------------------------------ crash safety

WRITER = r"""
import sys
from cgpud.node.model import Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.node.store import Store, new_instance_id

store = Store(sys.argv[1])
n = 0
while True:
    k = 1 + n % 4
    inst = Instance(
        id=new_instance_id(),
        owner=Owner(OwnerKind.CONTAINER, f"ctr-{n}"),
        grants=tuple(Grant(i, f"GPU-{i}", (i + 1) << 20, 0) for i in range(k)),
        state=InstanceState.RESERVED,
        enforced=True,
        weight=k,  # lets the checker know how many grants every row must have
        pids=tuple(range(1, k + 1)),
    )
    store.insert(inst)
    print("insert", inst.id, k, flush=True)
    if n % 3 == 0:
        store.set_state(inst.id, InstanceState.BOUND, pids=[n + 1])
        print("bound", inst.id, flush=True)
    if n % 7 == 0:
        store.set_state(inst.id, InstanceState.RELEASED)
        print("released", inst.id, flush=True)
    n += 1
"""


def _run_writer_and_kill(script: Path, db: Path, rng: random.Random) -> list[list[str]]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    chunks: list[bytes] = []
    lines_seen = threading.Event()

    # Drain the pipe continuously so the writer never blocks on a full pipe
    # and the kill lands in the middle of real database work.
    def drain() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):
            chunks.append(chunk)
            if b"".join(chunks).count(b"\n") >= 20:
                lines_seen.set()

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        if not lines_seen.wait(30):
            proc.kill()
            proc.wait()
            pytest.fail(f"writer produced no output: {proc.stderr.read().decode()}")
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        proc.stderr.close()
    out = b"".join(chunks).decode()
    # A line cut by the kill is dropped: only whole lines were surely printed.
    complete = out[: out.rfind("\n") + 1]
    return [line.split() for line in complete.splitlines()]


def test_crash_safety_under_sigkill(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    db = tmp_path / "crash" / "cgpud.db"
    rng = random.Random()
    inserted: dict[str, int] = {}
    bound: set[str] = set()
    released: set[str] = set()
    for _ in range(5):
        for event in _run_writer_and_kill(script, db, rng):
            if event[0] == "insert":
                inserted[event[1]] = int(event[2])
            elif event[0] == "bound":
                bound.add(event[1])
            else:
                released.add(event[1])
        # Each round reopens the very file the killed writer left behind.
        with Store(db) as s:
            found = {i.id: i for i in s.list(include_released=True)}
        for iid, k in inserted.items():
            assert iid in found, f"{iid} was printed after its commit but is gone"
            assert len(found[iid].grants) == k
        for iid in bound - released:
            assert found[iid].state in (BOUND, RELEASED)
        for iid in released:
            assert found[iid].state is RELEASED
        # Nothing half-written, including rows committed but not yet printed.
        for inst in found.values():
            assert len(inst.grants) == inst.weight, f"{inst.id} has a partial set of grants"
        conn = raw(db)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert (
            conn.execute("SELECT count(*) FROM grants WHERE instance_id NOT IN (SELECT id FROM instances)").fetchone()[
                0
            ]
            == 0
        )
        conn.close()
    assert len(inserted) >= 100


def test_a_version_1_file_opens_and_gains_the_holder_column(db: Path) -> None:
    # The file as cgpud 0.1 wrote it: no `holder`, schema_version 1.
    db.parent.mkdir(mode=0o700)
    conn = raw(db)
    conn.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE instances (id TEXT PRIMARY KEY, owner_kind TEXT NOT NULL, owner_id TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('reserved', 'bound', 'released')),
            enforced INTEGER NOT NULL CHECK (enforced IN (0, 1)), weight INTEGER NOT NULL,
            priority INTEGER NOT NULL, pids TEXT NOT NULL DEFAULT '[]', boot_id TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL, updated REAL NOT NULL);
        CREATE INDEX instances_by_state ON instances (state, created, id);
        CREATE TABLE grants (instance_id TEXT NOT NULL REFERENCES instances (id) ON DELETE CASCADE,
            gpu_index INTEGER NOT NULL, gpu_uuid TEXT NOT NULL, memory INTEGER NOT NULL CHECK (memory >= 0),
            core_percent INTEGER NOT NULL CHECK (core_percent BETWEEN 0 AND 100), PRIMARY KEY (instance_id, gpu_index));
        INSERT INTO meta VALUES ('schema_version', '1');
        INSERT INTO instances VALUES ('cgpu-old', 'device', 'd', 'bound', 1, 1, 0, '[42]', 'b', 1.0, 2.0);
        INSERT INTO grants VALUES ('cgpu-old', 0, 'GPU-0', 1048576, 0);
    """)
    conn.close()
    with Store(db) as s:
        old = s.get("cgpu-old")
        assert (old.state, old.pids, old.holder, old.owner.id) == (InstanceState.BOUND, (42,), "", "d")
        assert s.set_state("cgpu-old", InstanceState.BOUND, holder="job@/b").holder == "job@/b"
    conn = raw(db)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    conn.close()
    with Store(db) as s:  # and opens again as the current version
        assert s.get("cgpu-old").holder == "job@/b"


def _selects(store: Store) -> list[str]:
    """The SELECTs the store's connection runs from now on."""
    seen: list[str] = []
    store._connection().set_trace_callback(lambda sql: seen.append(sql) if sql.lstrip().startswith("SELECT") else None)
    return seen


def test_holdings_are_read_again_only_after_a_write(store: Store) -> None:
    a = store.insert(make())
    assert [i.id for i in store.active()] == [a.id]
    selects = _selects(store)
    assert [i.id for i in store.active()] == [a.id] and store.holdings() == ([a], [])
    assert selects == []  # nothing committed since: no table read
    b = store.insert(make(created=1.0))
    assert {i.id for i in store.active()} == {a.id, b.id}
    store.set_state(a.id, RELEASED)
    assert [i.id for i in store.holdings()[0]] == [b.id]


def test_holdings_see_a_commit_by_another_connection(store: Store, db: Path) -> None:
    a = store.insert(make())
    assert [i.id for i in store.active()] == [a.id]
    with Store(db) as other:
        b = other.insert(make(created=1.0))
        other.set_state(a.id, RELEASED)
    assert [i.id for i in store.active()] == [b.id]
    with raw(db) as conn:
        conn.execute("UPDATE instances SET state = ? WHERE id = ?", (RELEASED.value, b.id))
    assert store.active() == []


def test_holdings_are_copies(store: Store) -> None:
    store.insert(make())
    store.active().clear()
    assert len(store.active()) == 1
