"""A node's budget for its weights directory: the bytes its weights may take, and
which go when a fetch needs room.

Theory of operation
-------------------
What counts against the budget (``limit_bytes``) is every file under the
weights directory that is weights or on the way to be: the landed files, the
``.part`` files on disk, and each fetch in flight through this ``Budget``
(``reserve``) at the whole size of its file, since that is what it will take
once landed (its ``.part``, counted in that, is not counted again). A fetch
needs room twice: within the budget, and on the disk, where ``statvfs``'s
free bytes less what the other fetches in flight have still to write must
hold what it has still to write.

When there is not room, the weights unused for longest go first, one after
the other, until there is. "Used" is when an engine last started on a file:
the caller says so (``mark_used``, which writes ``.NAME.used`` atomically,
since atime is not kept on most mounts); a file never marked, copied by hand
or landed by a fetch, counts as used when it was last written (its mtime).
A ``.part`` no fetch of this budget holds, left by one that ended, goes in
the same order, by its mtime.

Never evicted: a file a replica uses (``set_in_use``, and the caller's own
``pinned``), the target and ``.part`` of a fetch in flight, and a ``.part``
another process holds locked (found at the moment of removing it, and then
left, and the choice made again without it). The choice is made whole before
anything is removed (``plan_room``, pure): a fetch that cannot fit even with
every evictable file gone removes nothing and fails with one line
(``NoRoom``) saying how much it needs, the budget, and what holds the rest.

Evicting a landed file removes it, every file kept about it
(``part.sidecars``: its sha256, commit, last use, chunks) and any ``.part``
of it no fetch holds; each eviction is one INFO line saying why. Nothing
outside the weights directory is touched, nor followed into: symbolic links
and hidden files are neither counted nor removed.

Deciding and evicting run under one lock, so two fetches of this process
never count the same room; they block (a scan of the folder, unlinks), and
the fetch calls them in a worker thread. A fetch of another process is seen
only by its ``.part`` on disk, at the size it has so far.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from llmgw.files import write_atomic
from llmgw.weights import part as parts
from llmgw.weights.errors import NoRoom

log = logging.getLogger("llmgw.weights")

_NAMED = 3  # of the files that hold the room, named in a NoRoom line


@attrs.frozen
class Held:
    """A file of the weights directory, as the budget counts it."""

    path: Path
    size: int  # bytes it counts for (a fetch in flight: its file's whole size)
    last_used: float  # Unix time: the last mark_used, else its mtime
    pinned: bool  # in use, or a fetch's: never evicted
    partial: bool = False  # a .part (or a fetch in flight), not a landed file


@attrs.frozen
class Plan:
    """What ``plan_room`` chose: the files to evict, oldest use first, or, when
    even evicting every one would not make room, none, and by how much it
    falls short."""

    evict: tuple[Held, ...]
    over_budget: int = 0  # bytes past the budget with every evictable file gone
    over_disk: int = 0  # bytes past the disk's free bytes, likewise

    @property
    def fits(self) -> bool:
        return self.over_budget <= 0 and self.over_disk <= 0


def plan_room(held: Sequence[Held], *, needed: int, limit: int, free: int) -> Plan:
    """Which of ``held`` to evict so that ``needed`` more bytes fit both within
    ``limit`` (with all of ``held`` counted) and in ``free`` bytes of disk: the
    fewest, unused for longest first, never a pinned one. Pure."""
    over_budget = sum(h.size for h in held) + needed - limit
    over_disk = needed - free
    chosen: list[Held] = []
    for h in sorted((h for h in held if not h.pinned), key=lambda h: (h.last_used, str(h.path))):
        if over_budget <= 0 and over_disk <= 0:
            break
        chosen.append(h)
        over_budget -= h.size
        over_disk -= h.size
    if over_budget > 0 or over_disk > 0:
        return Plan(evict=(), over_budget=over_budget, over_disk=over_disk)
    return Plan(evict=tuple(chosen))


def no_room_line(
    name: str, where: Path, held: Sequence[Held], *, needed: int, limit: int, free: int, plan: Plan
) -> str:
    """The one line a fetch that cannot fit fails with: what it needs, the
    budget or the disk, and what holds the room. Pure."""
    pinned = sorted((h for h in held if h.pinned), key=lambda h: -h.size)
    named = [f"{h.path.name} {parts.human(h.size)}" for h in pinned[:_NAMED]]
    if len(pinned) > _NAMED:
        named.append(f"{len(pinned) - _NAMED} more")
    held_by = f"; in use or being fetched: {', '.join(named)}" if named else ""
    if plan.over_budget > 0:
        return (
            f"no room for {name} in {where} within its budget of {parts.human(limit)}:"
            f" {parts.human(needed)} needed,"
            f" {parts.human(sum(h.size for h in pinned))} held by files no fetch may evict"
            f"{held_by}; raise the budget ([weights] budget_gb) or stop a replica using one"
        )
    return (
        f"no room for {name} in {where}: {parts.human(needed)} needed,"
        f" {parts.human(free)} free on its disk even with every file not in use evicted"
        f"{held_by}; free space on the disk or stop a replica using one"
    )


@attrs.frozen
class _Flight:
    target: Path
    part: Path
    size: int  # the whole file's


class Reservation:
    """The room a fetch holds (``Budget.reserve``), until ``release``."""

    def __init__(self, budget: Budget, key: object, evicted: list[Path]) -> None:
        self._budget = budget
        self._key = key
        self.evicted = evicted  # what was removed to make the room

    def release(self) -> None:
        """The fetch has ended: what it landed, or left, counts as a file of the
        directory from now on. Never blocks for long: call it on the event loop."""
        self._budget._release(self._key)


class Budget:
    """The budget of ``weights_dir``: at most ``limit_bytes`` of weights in it.

    One per weights directory per process, shared by every fetch into it. Its
    methods but ``set_in_use`` and ``covers`` block (disk): call them in a
    worker thread.
    """

    def __init__(self, weights_dir: Path, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"a weights budget must be more than 0 bytes, not {limit_bytes}")
        self.root = Path(os.path.abspath(weights_dir))
        self.limit = limit_bytes
        self._in_use: frozenset[Path] = frozenset()
        self._flights: dict[object, _Flight] = {}  # by reservation
        self._flights_lock = threading.Lock()  # brief: release() is called on the event loop
        self._deciding = threading.Lock()  # a scan, a choice and its evictions

    def covers(self, path: Path) -> bool:
        """Whether ``path`` is in the weights directory this budget bounds."""
        return Path(os.path.abspath(path)).is_relative_to(self.root)

    def set_in_use(self, paths: Iterable[Path]) -> None:
        """The files the node's replicas use now (starting or running): never
        evicted. Replaces what was set before."""
        self._in_use = frozenset(Path(os.path.abspath(p)) for p in paths)

    def mark_used(self, path: Path, at: float | None = None) -> None:
        """An engine starts on ``path`` (at ``at``, Unix time; now by default):
        it is the last to go. Nothing is written for a file outside the
        weights directory (a shared mount's).

        Raises:
            OSError: the record could not be written.
        """
        path = Path(os.path.abspath(path))
        if not self.covers(path) or not path.is_file():
            return
        when = time.time() if at is None else at
        write_atomic(_used_path(path), f"{when:.3f}\n".encode(), mode=0o644)

    def held(self, pinned: Iterable[Path] = ()) -> list[Held]:
        """What the weights directory holds, unused for longest first: landed
        files, and ``.part`` files (``partial``) at their size so far."""
        pins = self._pins(pinned)
        with self._flights_lock:
            flying = {p for f in self._flights.values() for p in (f.target, f.part)}
        return [
            attrs.evolve(h, pinned=_under(h.path, pins) or h.path in flying or h.pinned)
            for h in _scan(self.root)
        ]

    def make_room(self, needed: int, pinned: Iterable[Path] = ()) -> list[Path]:
        """Evict until ``needed`` more bytes fit within the budget and on the
        disk: the paths removed.

        Raises:
            NoRoom: they cannot fit even with every evictable file gone;
                nothing was removed.
        """
        with self._deciding:
            return self._make_room(f"{parts.human(needed)} more", needed, 0, self._pins(pinned))

    def reserve(self, target: Path, part: Path, size: int, kept: int) -> Reservation:
        """Make room for a fetch of ``target`` (``size`` bytes, ``kept`` of them
        in its ``part`` already), evicting what must go, and hold it until the
        reservation is released.

        Raises:
            NoRoom: it cannot fit; nothing was removed, nothing is held.
        """
        target, part = Path(os.path.abspath(target)), Path(os.path.abspath(part))
        key = object()
        with self._deciding:
            pins = self._pins([target, part])
            evicted = self._make_room(target.name, size - kept, kept, pins, part)
            with self._flights_lock:
                self._flights[key] = _Flight(target, part, size)
        return Reservation(self, key, evicted)

    def _release(self, key: object) -> None:
        with self._flights_lock:
            self._flights.pop(key, None)

    def _pins(self, pinned: Iterable[Path]) -> frozenset[Path]:
        return self._in_use | {Path(os.path.abspath(p)) for p in pinned}

    def _make_room(
        self, name: str, needed: int, kept: int, pins: frozenset[Path], own: Path | None = None
    ) -> list[Path]:
        """Under ``_deciding``: choose, evict, and choose again should a file
        chosen turn out to be held by another process."""
        refused: set[Path] = set()
        evicted: list[Path] = []
        while True:
            held, free = self._counted(pins | refused, own, kept)
            plan = plan_room(held, needed=needed, limit=self.limit, free=free)
            if not plan.fits:
                raise NoRoom(
                    no_room_line(
                        name, self.root, held, needed=needed, limit=self.limit, free=free, plan=plan
                    )
                )
            if not plan.evict:
                return evicted
            for h in plan.evict:
                if _evict(h):
                    evicted.append(h.path)
                    log.info(
                        "evicted %s (%s, last used %s) from %s: room for %s within its budget"
                        " of %s",
                        h.path,
                        parts.human(h.size),
                        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.last_used)),
                        self.root,
                        name,
                        parts.human(self.limit),
                    )
                else:
                    refused.add(h.path)  # another process's: choose again without it

    def _counted(
        self, pins: frozenset[Path], own: Path | None, kept: int
    ) -> tuple[list[Held], int]:
        """What counts against the budget, and the disk's free bytes less what
        the fetches in flight have still to write."""
        with self._flights_lock:
            flights = list(self._flights.values())
        targets = {f.target for f in flights}
        flying = {f.part for f in flights}
        held: list[Held] = []
        for h in _scan(self.root):
            if h.path in flying:
                continue  # counted below, at its file's whole size
            if h.path == own:
                held.append(attrs.evolve(h, size=kept, pinned=True))
            else:
                pinned = h.pinned or _under(h.path, pins) or h.path in targets
                held.append(attrs.evolve(h, pinned=pinned))
        to_write = 0
        for f in flights:
            try:
                so_far = f.part.stat().st_size
            except OSError:
                so_far = 0
            to_write += max(0, f.size - so_far)
            held.append(Held(path=f.target, size=f.size, last_used=0.0, pinned=True, partial=True))
        self.root.mkdir(parents=True, exist_ok=True)
        return held, parts.free_bytes(self.root) - to_write


def _used_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.used")


def _under(path: Path, pins: frozenset[Path]) -> bool:
    """Whether ``path`` is pinned: itself, or a folder it is in (a repository's, in use)."""
    return path in pins or any(parent in pins for parent in path.parents)


def last_used(target: Path, mtime: float) -> float:
    """When an engine last started on ``target`` (``mark_used``), else ``mtime``."""
    try:
        return float(_used_path(target).read_text().strip())
    except (OSError, UnicodeDecodeError, ValueError):
        return mtime  # never marked: copied by hand, or not started on since it landed


def _scan(root: Path) -> list[Held]:
    """The weights files and ``.part`` files under ``root``, unused for longest
    first; none pinned yet."""
    found: list[Held] = []
    for folder, dirs, files in os.walk(root):  # never into a linked folder
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue  # a file kept about another, or a write in progress
            path = Path(folder, name)
            try:
                st = path.lstat()
            except OSError:
                continue  # gone meanwhile
            if not stat.S_ISREG(st.st_mode):  # a link is not followed, nor removed
                continue
            if parts.is_part(path):
                found.append(Held(path, st.st_size, st.st_mtime, pinned=False, partial=True))
            else:
                used = last_used(path, st.st_mtime)
                found.append(Held(path, st.st_size, used, pinned=False))
    found.sort(key=lambda h: (h.last_used, str(h.path)))
    return found


def _evict(h: Held) -> bool:
    """Remove ``h`` and what is kept about it; False when another process holds
    it (a ``.part`` being written) and it is left."""
    if h.partial:
        return _drop_part(h.path)
    h.path.unlink(missing_ok=True)
    for sidecar in parts.sidecars(h.path):
        sidecar.unlink(missing_ok=True)
    parts.drop_stale(h.path, keep=None)
    return True


def _drop_part(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a fetch of another process is writing it
    else:
        path.unlink(missing_ok=True)
        for sidecar in parts.sidecars(path):  # a peer fetch's chunks of it
            sidecar.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)
