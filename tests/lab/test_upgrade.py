"""An upgrade with no request failed and no engine restarted, in the lab.

A fleet (a control plane, two nodes with real llama-servers, two standalone
routers) runs on the single file built from an older commit, and takes traffic
through both routers from clients that go through a load balancer's rotation.
Then, one daemon at a time, each is replaced by the single file of this
checkout, as README's "Upgrading" says: each router taken out of the rotation
while it is replaced, then the control plane, then each node's agent. No
request fails, every engine is the same process at the end, no replica is
placed anew, and every daemon runs the new build.

The older commit is a fixed, named one that speaks today's agent protocol:
main's tip before the control-plane restart work (``OLD``). It is built from
this repository's own history (tests/builds.py); a shallow checkout that lacks
it fails here, saying how to fetch it. Both files are built once a session.
Root only (the lab makes namespaces); it fails, never skips, where they cannot
be made.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.protocol.version import SUBPROTOCOL
from tests.builds import built, protocol_of
from tests.lab.test_lab import _base36
from tests.realparts import needs_server
from tools.support.faults import MODEL, Outcome, not_whole, one_request, wait_whole
from tools.support.fleetapi import served
from tools.support.lab import Lab, LabError, preflight
from tools.support.procs import started

OLD = "b9de406"  # main before routers kept routes across a restart; protocol v1


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The older commit's single file and this checkout's."""
    if protocol_of(OLD) != SUBPROTOCOL:
        pytest.fail(
            f"{OLD} speaks {protocol_of(OLD)}, this checkout {SUBPROTOCOL}: a fleet cannot be "
            "upgraded across a protocol change one daemon at a time; name a newer OLD"
        )
    return built(tmp_path_factory, OLD), built(tmp_path_factory)


def _build_of(pyz: Path) -> str:
    out = subprocess.run(
        [sys.executable, str(pyz), "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=dict(os.environ, PEX_ROOT=str(pyz.parent / "pex")),
    ).stdout
    return out.strip().split("(build ", 1)[1].rstrip(")")


class Balanced:
    """Clients behind a load balancer of the routers: each request goes to the next
    router in the rotation, on a connection of its own. A router taken out gets no
    new request, and is handed back only once none of its requests is in flight."""

    def __init__(self, base_urls: list[str], key: str, clients: int = 4) -> None:
        self.rotation = list(base_urls)
        self.key = key
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.outcomes: list[tuple[str, Outcome]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i, base_urls), daemon=True)
            for i in range(clients)
        ]

    def __enter__(self) -> Balanced:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)

    def _client(self, i: int, base_urls: list[str]) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        fresh = httpx.Limits(max_keepalive_connections=0)  # a router replaced leaves none
        clients = {
            u: httpx.Client(base_url=u, headers=headers, timeout=30, limits=fresh)
            for u in base_urls
        }
        n = i
        try:
            while not self._stop.is_set():
                with self._lock:
                    url = self.rotation[n % len(self.rotation)]
                    self.in_flight[url] += 1
                try:
                    out = one_request(clients[url], stream=n % 2 == 1)
                finally:
                    with self._lock:
                        self.in_flight[url] -= 1
                with self._lock:
                    self.outcomes.append((url, out))
                n += 1
                self._stop.wait(0.02)
        finally:
            for c in clients.values():
                c.close()

    def take_out(self, url: str, timeout: float = 30) -> None:
        with self._lock:
            self.rotation.remove(url)
        deadline = time.monotonic() + timeout
        while self.in_flight[url]:
            assert time.monotonic() < deadline, f"{url} still has requests after {timeout} s"
            time.sleep(0.01)

    def put_back(self, url: str) -> None:
        with self._lock:
            self.rotation.append(url)


def _whole(lab: Lab, timeout: float = 90) -> None:
    if wait_whole(lab, timeout) is None:
        pytest.fail(f"the fleet is not whole {timeout:g} s on: {not_whole(lab)}")


def _engines(lab: Lab) -> dict[int, str]:
    """Every engine's pid, with when it started (a restarted one is another process)."""
    return {pid: started(pid) for node in lab.state["nodes"] for pid in lab.engine_pids(node)}


@pytest.fixture
def lab(tmp_path_factory: pytest.TempPathFactory, files: tuple[Path, Path]) -> Iterator[Lab]:
    try:
        preflight()
    except LabError as e:
        pytest.fail(f"the lab cannot run here: {e}")
    old, _ = files
    lab = Lab(
        tmp_path_factory.mktemp("upgrade"),
        name="u" + _base36(os.getpid())[-4:],
        nodes=2,
        routers=2,
        program=[sys.executable, str(old)],
    )
    try:
        lab.up(timeout=180)
        lab.set_replicas(2)
        _whole(lab)
        yield lab
    finally:
        lab.down()


@needs_server
def test_a_fleet_upgraded_one_daemon_at_a_time_fails_no_request_restarts_no_engine(
    lab: Lab, files: tuple[Path, Path]
) -> None:
    old, new = files
    old_build, new_build = _build_of(old), _build_of(new)
    assert old_build.startswith(OLD) and old_build != new_build
    assert {n["version"].split("(build ")[1].rstrip(")") for n in lab.nodes()} == {old_build}
    engines = _engines(lab)
    replicas = sorted(r["replica_id"] for r in lab.replicas() if r["model"] == MODEL)
    assert len(engines) == 2 and len(replicas) == 2
    program = [sys.executable, str(new)]
    steps: list[tuple[str, float]] = []
    with Balanced(lab.base_urls, lab.key) as traffic:
        time.sleep(2)
        for router, url in zip(lab.routers, lab.base_urls, strict=True):
            t0 = time.monotonic()
            traffic.take_out(url)  # the load balancer first: what it sent there ends
            lab.restart(router, program)
            deadline = time.monotonic() + 120
            while not served(url, lab.key):
                assert time.monotonic() < deadline, f"{router} does not serve: see its log"
                time.sleep(0.2)
            traffic.put_back(url)
            steps.append((router, time.monotonic() - t0))
            time.sleep(1)
        t0 = time.monotonic()
        lab.restart("cp", program)  # the routers route on meanwhile
        _whole(lab)
        steps.append(("cp", time.monotonic() - t0))
        time.sleep(1)
        for node in lab.node_names:
            t0 = time.monotonic()
            lab.restart(node, program)  # its engines serve on, and are adopted
            lab.wait_node(node, "Ready", timeout=120)
            _whole(lab)
            steps.append((node, time.monotonic() - t0))
            time.sleep(1)
        time.sleep(2)
    outcomes = traffic.outcomes
    failed = [(url, o) for url, o in outcomes if not o.ok]
    per_router = collections.Counter(url for url, _ in outcomes)
    print(
        f"upgraded {OLD} -> {new_build}: {len(outcomes)} requests, {len(failed)} failed; "
        + ", ".join(f"{who} {s:.1f} s" for who, s in steps)
    )
    assert failed == [], f"{len(failed)} of {len(outcomes)} failed: {failed[:5]}"
    assert all(per_router[u] > 20 for u in lab.base_urls), per_router
    assert _engines(lab) == engines  # the same processes: no engine restarted
    assert sorted(r["replica_id"] for r in lab.replicas() if r["model"] == MODEL) == replicas
    assert {n["version"].split("(build ")[1].rstrip(")") for n in lab.nodes()} == {new_build}
    said = httpx.get(
        lab.admin_url + "/v1/nodes",
        headers={"authorization": f"Bearer {lab.admin_token()}"},
        timeout=5,
    ).json()["server_version"]
    assert said.endswith(f"(build {new_build})"), said
    for router in lab.routers:  # each runs the new file now (pex says which, as PEX=)
        environ = Path(f"/proc/{lab.state['procs'][router]}/environ").read_bytes().split(b"\0")
        assert f"PEX={new}".encode() in environ, router
