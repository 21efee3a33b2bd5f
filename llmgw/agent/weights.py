"""The agent's fetches of weights: a shard's weights brought to its node before its
engine starts.

Theory of operation
-------------------
A shard whose spec names a source (``ShardSpec.weights_source``, a profile's
``source``) needs its weights at ``model_path`` before its engine starts; the
control plane put there where its source lands under this node's weights
directory (``Inventory.weights_dir``), or the profile's own ``model_path``.
``Fetcher.bring`` makes it so with ``llmgw.weights.fetch``: a file already
there and whole costs a look at the disk; one missing is fetched, resumed
from what a previous try left, and verified.

Peers first: where the control plane names agents of the fabric that hold the
file or are fetching it (``ShardSpec.weights_peers``), it is taken from them
(``llmgw.weights.peer``: over the agents' own mutual TLS, chunk by checked
chunk, a peer that is itself still fetching giving what it has so far), and
only what they cannot give is asked of the source, which resumes their
``.part``. Peers serve what lands where its source says, so a profile's own
``model_path`` elsewhere is fetched from the source.

One fetch per file at a time on a node: a second shard wanting the same file
follows the first's fetch (its progress, then its end) instead of starting
another, and takes over when the first is cancelled (its shard stopped).

A landed file gets its source recorded beside it (``fetched_record``), so
discovery reports it with its source (``WeightCopy.source``) and placement
knows this node holds it; a refresh of the inventory is asked for at once.
What is being fetched is in the inventory too (``fetching``): placement
prefers a node that is fetching a model's weights to one that is not.

What it counts: bytes fetched by where they came from (``hub``, ``url``,
``peer``; ``mount`` reads nothing), and failures by kind; a failure is one
line in the log (``fetch`` logs the start and the end of each fetch).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import attrs
import trio

from llmgw.agent.discovery.weights import fetched_record
from llmgw.files import write_atomic
from llmgw.protocol.messages import FetchProgress, FetchWeights, ShardSpec, WeightsPeer
from llmgw.weights.budget import Budget
from llmgw.weights.errors import Corrupt, FetchError, NoRoom, Stalled
from llmgw.weights.fetch import ask, fetch
from llmgw.weights.peer import Peer, PeerTrust, fetch_from_peer
from llmgw.weights.repo import TakeFirst, fetch_repo
from llmgw.weights.source import HubFile, HubRepo, MountFile, Source, UrlFile, parse_source
from llmgw.weights.transfer import Progress, ProgressCallback

log = logging.getLogger("llmgw.agent.weights")

# no chunk from any peer this long: the source is asked instead (resuming what came)
PEER_STALL_S = 30.0
# a source whose fetch found no room is said to have none here this long (placement
# looks elsewhere meanwhile), unless a fetch of it lands first
NO_ROOM_S = 300.0


def source_kind(source: Source) -> str:
    """The ``source`` label of the bytes-fetched counter."""
    if isinstance(source, HubFile | HubRepo):
        return "hub"
    if isinstance(source, UrlFile):
        return "url"
    assert isinstance(source, MountFile)
    return "mount"


def failure_kind(exc: FetchError) -> str:
    """The ``reason`` label of the failures counter."""
    if isinstance(exc, NoRoom):
        return "no_room"
    if isinstance(exc, Corrupt):
        return "corrupt"
    if isinstance(exc, Stalled):
        return "stalled"
    return "source"


@attrs.define(eq=False)
class _Fetch:
    """One file being fetched, and whoever follows it."""

    progress: FetchProgress
    done: trio.Event = attrs.Factory(trio.Event)
    path: Path | None = None  # landed here
    error: FetchError | None = None  # failed so; neither: cancelled, a follower fetches it


class Fetcher:
    """The node's fetches, one per file at a time (``bring``)."""

    def __init__(
        self,
        weights_dir: Path,
        *,
        on_bytes: Callable[[str, int], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
        on_landed: Callable[[], Awaitable[None]] | None = None,
        budget: Budget | None = None,
        in_use: Callable[[], Iterable[Path]] | None = None,
    ) -> None:
        self.weights_dir = weights_dir  # where fetched weights land ([weights] default_dir)
        # what the weights there may take (``[weights] budget_gb``), and the files the
        # node's shards use, which it never evicts
        self.budget = budget
        self.in_use = in_use or (lambda: ())
        # this agent's identity to other agents' transfer listeners (set by the daemon);
        # None: it takes nothing from peers
        self.trust: PeerTrust | None = None
        self.on_bytes = on_bytes or (lambda kind, n: None)
        self.on_failure = on_failure or (lambda kind: None)
        self.on_landed = on_landed
        self.running: dict[Path, _Fetch] = {}
        # sources whose last fetch found no room here, and until when that is said
        # (``no_room``): placement puts their replicas elsewhere meanwhile
        self._no_room: dict[str, float] = {}

    def no_room(self) -> list[str]:
        """The sources whose last fetch here found no room, lately (``NO_ROOM_S``)."""
        now = trio.current_time()
        self._no_room = {s: until for s, until in self._no_room.items() if until > now}
        return sorted(self._no_room)

    def fetching(self) -> list[FetchProgress]:
        """The fetches under way, and how far each has come."""
        return [f.progress for f in self.running.values()]

    async def bring(
        self, spec: ShardSpec, report: Callable[[FetchProgress], None] | None = None
    ) -> Path:
        """Where ``spec``'s weights are on this node, once they are whole; ``report``
        hears how far a fetch has come, a few times a second.

        Raises:
            FetchError: they cannot be had (the message, one line, says why).
        """
        return await self.bring_file(
            spec.weights_source,
            spec.model_path,
            sha256=spec.weights_sha256,
            stall_s=spec.fetch_stall_s,
            peers=spec.weights_peers,
            report=report,
        )

    async def prefetch(self, command: FetchWeights) -> None:
        """A ``FetchWeights`` command: the file, for no shard yet. A failure is logged
        and counted, and the file is tried again when a shard needs it."""
        try:
            await self.bring_file(
                command.source,
                command.path,
                sha256=command.sha256,
                stall_s=command.stall_s,
                peers=command.peers,
            )
        except FetchError:
            pass  # said and counted by bring_file

    async def bring_file(
        self,
        source_text: str,
        path: str,
        *,
        sha256: str = "",
        stall_s: float = 120.0,
        peers: Sequence[WeightsPeer] = (),
        report: Callable[[FetchProgress], None] | None = None,
    ) -> Path:
        """``bring`` of a source to ``path`` (empty: where the source lands here),
        from ``peers`` first where they can serve it."""
        try:
            source = parse_source(source_text)
        except ValueError as exc:
            raise FetchError(str(exc)) from None
        target = Path(path) if path else None
        if isinstance(source, MountFile):
            return await fetch(source, self.weights_dir)
        key = target or self.weights_dir / source.landing()
        while (running := self.running.get(key)) is not None:
            await self._follow(running, report)
            if running.path is not None:
                return running.path
            if running.error is not None:
                raise running.error
        mine = _Fetch(FetchProgress(source=str(source), path=str(key)))
        self.running[key] = mine
        # where the bytes come from now: a peer's node id, or "" for the source
        peer = [""]
        seen: list[int] = []  # the bytes at the last report; none before the first

        def progressed(p: Progress) -> None:
            if seen and p.done > seen[0]:  # a resumed fetch's first report is what it had
                self.on_bytes("peer" if peer[0] else source_kind(source), p.done - seen[0])
            seen[:] = [p.done]
            mine.progress = FetchProgress(
                source=str(source),
                path=str(key),
                done_bytes=p.done,
                total_bytes=p.total,
                rate_bps=p.rate,
                peer=peer[0],
            )
            if report is not None:
                report(mine.progress)

        if self.budget is not None:
            self.budget.set_in_use(self.in_use())
        try:
            landed = None
            if isinstance(source, HubRepo):  # a folder: peers give it file by file
                landed = await fetch_repo(
                    source,
                    self.weights_dir,
                    target=target,
                    stall_s=stall_s,
                    progress=progressed,
                    budget=self.budget,
                    first=self._take_files(source, target, stall_s, peers, peer),
                )
            elif self._may_take(source, target, peers):
                peer[0] = peers[0].node_id
                landed = await self._from_peers(source, target, sha256, stall_s, peers, progressed)
                peer[0] = ""
                seen.clear()
            if landed is None:
                landed = await fetch(
                    source,
                    self.weights_dir,
                    target=target,
                    sha256=sha256 or None,
                    stall_s=stall_s,
                    progress=progressed,
                    budget=self.budget,
                )
            await trio.to_thread.run_sync(
                lambda: write_atomic(fetched_record(landed), str(source).encode() + b"\n", 0o644)
            )
        except FetchError as exc:
            mine.error = exc
            self.on_failure(failure_kind(exc))
            if isinstance(exc, NoRoom):
                self._no_room[str(source)] = trio.current_time() + NO_ROOM_S
            log.warning("cannot fetch %s: %s", source, exc)
            raise
        finally:
            mine.done.set()
            del self.running[key]
        mine.path = landed
        self._no_room.pop(str(source), None)
        if self.on_landed is not None:
            await self.on_landed()
        return landed

    def _may_take(self, source: Source, target: Path | None, peers: Sequence[WeightsPeer]) -> bool:
        """Whether peers may serve the file: there are some, this agent can prove who
        it is to them, and it lands where its source says (what a peer serves)."""
        if not peers or self.trust is None or isinstance(source, MountFile):
            return False
        return target is None or target == self.weights_dir / source.landing()

    def _take_files(
        self,
        source: HubRepo,
        target: Path | None,
        stall_s: float,
        peers: Sequence[WeightsPeer],
        peer: list[str],
    ) -> TakeFirst | None:
        """For a repository's fetch: each file from ``peers`` before the hub, where
        they may serve it (``peer`` says whose bytes are coming, for the counter)."""
        if not self._may_take(source, target, peers):
            return None

        async def first(
            file: HubFile, path: Path, sha256: str | None, size: int, progressed: ProgressCallback
        ) -> Path | None:
            peer[0] = peers[0].node_id
            try:
                return await self._from_peers(
                    file, None, sha256 or "", stall_s, peers, progressed, size=size
                )
            finally:
                peer[0] = ""

        return first

    async def _from_peers(
        self,
        source: HubFile | UrlFile,
        target: Path | None,
        sha256: str,
        stall_s: float,
        peers: Sequence[WeightsPeer],
        progressed: Callable[[Progress], None],
        *,
        size: int | None = None,
    ) -> Path | None:
        """The file taken from ``peers``; None when they could not give it (said in
        one line: the source is asked next, and resumes what they gave).

        Raises:
            NoRoom: no room for it here, from wherever it comes.
        """
        assert self.trust is not None
        expect = sha256 or None
        if size is None or expect is None:
            try:  # a peer still fetching it is found by what the source says it is
                remote = await ask(source, token=None, endpoint=None, verify=True)
                size, expect = remote.size, expect or remote.sha256
            except FetchError as exc:
                log.info("%s: taking it from peers without the source's word: %s", source, exc)
        budget = self.budget
        if budget is not None and size is not None:
            pinned = list(self.in_use())
            await trio.to_thread.run_sync(budget.make_room, size, pinned)
        takers = [Peer(p.node_id, p.host, p.port) for p in peers]
        try:
            return await fetch_from_peer(
                source,
                self.weights_dir,
                takers,
                self.trust,
                target=target,
                sha256=expect,
                size=size,
                stall_s=min(stall_s, PEER_STALL_S),
                progress=progressed,
            )
        except NoRoom:
            raise
        except FetchError as exc:
            log.warning(
                "cannot take %s from %s: %s; fetching it from its source",
                source,
                ", ".join(p.node_id for p in peers),
                exc,
            )
            return None

    async def used(self, path: str) -> None:
        """An engine started on ``path``: under a budget, it is the last to go."""
        budget = self.budget
        if budget is None or not path:
            return
        try:
            await trio.to_thread.run_sync(budget.mark_used, Path(path))
        except OSError as exc:
            log.warning("cannot record that %s is in use: %s", path, exc.strerror or exc)

    async def _follow(
        self, running: _Fetch, report: Callable[[FetchProgress], None] | None
    ) -> None:
        """Until another shard's fetch of the same file ends, hearing its progress."""
        while not running.done.is_set():
            if report is not None:
                report(running.progress)
            with trio.move_on_after(0.25):
                await running.done.wait()
