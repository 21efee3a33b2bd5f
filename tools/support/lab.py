"""The lab: a fleet of N nodes on one Linux machine, built with ``ip`` and ``unshare``.

Each node is a network namespace with its own address on a bridge and its own
hostname (a UTS namespace), so each agent has its own node id and address. The
control plane runs in a namespace of its own; a standalone router (``llmgw
router``, as production runs it) runs on the host and listens on the bridge's
host address (with ``routers=2``, a second one on the next port). Everything
created is recorded in ``DIR/lab.json`` as it is made, so ``down`` removes
exactly that, even after a half-finished ``up``. Each daemon runs this
checkout's llmgw, or a single file given (``program``), which ``replace``
changes for one daemon at a time: an upgrade, as an operator makes it.

Used by ``tools/lab`` (people: ``tools/lab.py`` is its command line), the fault
benchmark and ``tests/lab`` (tests): the same code. Root only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from llmgw.agent.discovery.engines import find_llama_server
from llmgw.router.keys import hash_key, new_key
from llmgw.tls import init_ca, issue_agent, issue_server, load_ca
from tools.support import fleetapi, labwire
from tools.support.catalogs import write_tiny_catalog
from tools.support.procs import ROOT, Proc, alive, llmgw, started

# what cannot exist on a machine without GPUs, in the lab's GPU mode (``up --gpus``):
# nvidia-smi's output from a real H200 node, and vLLM and Ray as the suite's stand-ins
FAKE_NVIDIA_SMI = ROOT / "tests" / "agent" / "discovery" / "fake_nvidia_smi.py"
STANDINS = ROOT / "tests" / "engines" / "standins"
WIDE_MODEL = "wide"  # the lab's vLLM-over-Ray model: one GPU on each of two nodes
STREAM_PORT = 7443
ADMIN_PORT = 7444
ROUTER_PORT = 8000
NAME_RE = re.compile(r"[a-z0-9]{1,5}")  # links are llmgw-NAME-n99: at most 15 characters


class LabError(Exception):
    """One line for the operator: what went wrong and what to do."""


def default_dir(name: str) -> Path:
    return Path(f"/tmp/llmgw-lab-{name}")


def preflight() -> None:
    """Why namespaces cannot be made here, or nothing."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root (it makes namespaces, a bridge and veths): run as root")
    for tool in ("ip", "unshare", "tc", "mount"):
        if shutil.which(tool) is None:
            raise LabError(f"the lab needs {tool!r} on PATH: install iproute2 / util-linux")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed: {(r.stderr or r.stdout).strip()}")
    return r


def _signal_number(sig: str | int) -> int:
    if isinstance(sig, int) or sig.isdigit():
        return int(sig)
    name = sig.upper()
    number = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
    if not isinstance(number, signal.Signals):
        raise LabError(f"--signal {sig}: not a signal (try 9, KILL, TERM, STOP, CONT)")
    return int(number)


class Lab:
    """A lab's state: what it made (``lab.json``) and the verbs that act on it."""

    def __init__(
        self,
        dir: Path | None = None,
        *,
        name: str = "lab0",
        nodes: int = 2,
        small_disk: tuple[str, ...] = (),
        heartbeat_s: float = 0.5,
        unreachable_after_s: float = 2.0,
        lost_after_s: float = 30.0,
        gpus: bool = False,
        routers: int = 1,
        program: list[str] | None = None,
        agent_config: str = "",
        agent_env: dict[str, str] | None = None,
        extra_catalog: str = "",
        before_start: Callable[[Lab], None] | None = None,
    ) -> None:
        if not NAME_RE.fullmatch(name):
            raise LabError(f"lab name {name!r}: use 1-5 characters a-z, 0-9 (it names links)")
        if not 1 <= nodes <= 99:
            raise LabError(f"{nodes} nodes: the lab makes 1 to 99")
        self.name = name
        self.dir = (dir or default_dir(name)).resolve()
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        for node in small_disk:
            if node not in self.node_names:
                raise LabError(f"--small-disk {node}: no such node (nodes are n1..n{nodes})")
        self.small_disk = tuple(small_disk)
        self.liveness = (heartbeat_s, unreachable_after_s, lost_after_s)
        if gpus and nodes < 2:
            raise LabError("--gpus serves a model over two nodes: make at least 2")
        self.gpus = gpus
        if not 1 <= routers <= 9:
            raise LabError(f"{routers} routers: the lab runs 1 to 9")
        self.routers = ["router"] + [f"router{i}" for i in range(2, routers + 1)]
        # what runs every daemon: this checkout's llmgw, or a single file (tools/build)
        self.program = program or llmgw()
        self.state: dict[str, Any] = {}
        self._procs: dict[int, Proc] = {}  # what this process started, by pid
        # for a benchmark's own fleet: more of each agent's config (``{node}`` is its
        # name), more of each agent's environment, more models in the catalog, and what
        # to do once the network is up and before any daemon starts (start a server on
        # the bridge, say, that ``agent_env`` then points at)
        self.agent_config = agent_config
        self.agent_env = dict(agent_env or {})
        self.extra_catalog = extra_catalog
        self.before_start = before_start

    # -- the record -------------------------------------------------------------

    @classmethod
    def load(cls, dir: Path) -> Lab:
        record = dir.resolve() / "lab.json"
        try:
            state = json.loads(record.read_text())
        except FileNotFoundError:
            raise LabError(f"no lab at {dir} (no lab.json): give the --dir of `up`") from None
        lab = cls(
            dir,
            name=state["name"],
            nodes=max(2, len(state.get("nodes", {}))),
            routers=len(state.get("routers", ["router"])),
        )
        lab.gpus = bool(state.get("gpus"))
        lab.state = state
        return lab

    def _save(self) -> None:
        tmp = self.dir / "lab.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        tmp.replace(self.dir / "lab.json")

    def _note(self, kind: str, value: str) -> None:
        """Record a thing before it is made, so a failure halfway still removes it."""
        self.state.setdefault(kind, [])
        if value not in self.state[kind]:
            self.state[kind].append(value)
        self._save()

    @property
    def base_url(self) -> str:
        return str(self.state["base_url"])

    @property
    def base_urls(self) -> list[str]:
        """Every router's base URL, the first one's first."""
        return [str(u) for u in self.state.get("base_urls", [self.state["base_url"]])]

    @property
    def key(self) -> str:
        return str(self.state["key"])

    @property
    def admin_url(self) -> str:
        return str(self.state["admin_url"])

    def address(self, node: str) -> str:
        return str(self._node(node)["ip"])

    def _node(self, node: str) -> dict[str, Any]:
        nodes: dict[str, dict[str, Any]] = self.state["nodes"]
        if node not in nodes:
            raise LabError(f"no node {node!r} in this lab: nodes are {', '.join(nodes)}")
        return nodes[node]

    def admin_token(self) -> str:
        return (self.dir / "state" / "admin-token").read_text().strip()

    # -- up ---------------------------------------------------------------------

    def up(self, timeout: float = 120) -> None:
        """Build the network, start every daemon, and wait until the router serves."""
        preflight()
        if (self.dir / "lab.json").exists():
            old = json.loads((self.dir / "lab.json").read_text())
            if old.get("namespaces") or old.get("links") or old.get("procs"):
                raise LabError(
                    f"a lab is already up in {self.dir}: `tools/lab down --dir {self.dir}`"
                )
        self.dir.mkdir(parents=True, exist_ok=True)
        prefix = f"llmgw-{self.name}-"
        subnet = self._free_subnet()
        self.state = {
            "name": self.name,
            "subnet": subnet,
            "bridge": prefix + "br",
            "namespaces": [],
            "links": [],
            "mounts": [],
            "procs": {},
            "nodes": {},
            "gpus": self.gpus,
            "routers": self.routers,
            "programs": {},
        }
        self._save()
        try:
            self._network(prefix, subnet)
            self._files()
            if self.before_start is not None:
                self.before_start(self)
            self._start_all(timeout)
        except BaseException:
            self.down()
            raise

    def _free_subnet(self) -> str:
        """A /24 in 10.0.0.0/8 that no address or route of the host overlaps."""
        text = _run("ip", "-4", "-o", "addr").stdout + _run("ip", "-4", "route").stdout
        used = []
        for word in text.split():
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(word, strict=False))
        h = int.from_bytes(hashlib.sha256(self.name.encode()).digest()[:2], "big")
        for i in range(256):
            net = f"10.{100 + (h >> 8) % 100}.{(h + i) % 256}"
            mine = ipaddress.ip_network(f"{net}.0/24")
            if not any(mine.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise LabError("no free 10.x.y.0/24 for the lab's bridge: remove an old lab (`down`)")

    def _network(self, prefix: str, subnet: str) -> None:
        bridge = self.state["bridge"]
        self._note("links", bridge)
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        self.state["host_ip"] = f"{subnet}.1"
        members = [("cp", f"{subnet}.2")] + [
            (node, f"{subnet}.{10 + i}") for i, node in enumerate(self.node_names)
        ]
        for member, ip in members:
            ns, veth = prefix + member, prefix + member
            self._note("namespaces", ns)
            _run("ip", "netns", "add", ns)
            self._note("links", veth)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            entry = {"ns": ns, "veth": veth, "ip": ip}
            if member == "cp":
                self.state["cp"] = entry
            else:
                self.state["nodes"][member] = entry
        self._save()

    def _files(self) -> None:
        d = self.dir
        cp_ip = self.state["cp"]["ip"]
        pki = d / "pki"
        if not (pki / "ca.pem").exists():
            init_ca(pki)
        ca = load_ca(pki)
        issue_server(ca, [cp_ip, "127.0.0.1"], pki)
        for node in self.node_names:
            issue_agent(ca, node, pki)
        catalog = write_tiny_catalog(d)
        if self.extra_catalog:
            with catalog.open("a") as f:
                f.write(self.extra_catalog)
        if self.gpus:
            with catalog.open("a") as f:
                f.write(
                    f"""
# vLLM over Ray (the suite's stand-ins), one GPU on each of two nodes of one fabric
[models.{WIDE_MODEL}]
replicas = 1
[[models.{WIDE_MODEL}.profiles]]
name = "ray"
engine = "vllm-ray"
gpus = 1
nodes = 2
startup_timeout_s = 60
settings = {{ ray_port = 6390 }}
"""
                )
        key = new_key()
        (d / "api-key").write_text(key + "\n")
        (d / "api-key").chmod(0o600)
        heartbeat, unreachable, lost = self.liveness
        (d / "server.toml").write_text(
            f"""# the lab's control plane, in its own namespace
state_dir = "state"
catalog = "catalog.toml"
[reconcile]
settle_s = 3  # agents (backoff at most 1 s) are back within it after a restart
drain_grace_s = 10  # a drain with no room for a replacement ends within seconds
[liveness]  # short, so a partition shows within seconds
heartbeat_interval_s = {heartbeat}
unreachable_after_s = {unreachable}
lost_after_s = {lost}
[agent_stream]
listen = "{cp_ip}:{STREAM_PORT}"
[admin]
# on the lab's private bridge, for the standalone router and ctl on the host
listen = "{cp_ip}:{ADMIN_PORT}"
insecure_listen = true
"""
        )
        host_ip = self.state["host_ip"]
        for i, router in enumerate(self.routers):
            (d / f"{router}.toml").write_text(
                f"""# the lab's standalone router, on the host: routes on without the control plane
admin_url = "http://{cp_ip}:{ADMIN_PORT}"
admin_token_file = "state/admin-token"
workers = 1
[router]
listen = "{host_ip}:{ROUTER_PORT + i}"
[[router.keys]]
name = "lab"
sha256 = "{hash_key(key)}"
"""
            )
        for node in self.node_names:
            (d / f"agent-{node}.toml").write_text(
                f'control_plane = ["{cp_ip}:{STREAM_PORT}"]\nstate_dir = "agent-{node}"\n'
                # back within a second of a restarted control plane, inside its settle time
                + "[backoff]\ninitial_s = 0.25\nmax_s = 1\n"
                + (self._gpu_node(node) if self.gpus else "")
                + self.agent_config.replace("{node}", node)
            )
            state_dir = d / f"agent-{node}"
            state_dir.mkdir(exist_ok=True)
            if node in self.small_disk:
                self._note("mounts", str(state_dir))
                _run(
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    "size=16m",
                    f"llmgw-{self.name}-{node}",
                    str(state_dir),
                )
        self.state["key"] = key
        self.state["base_url"] = f"http://{host_ip}:{ROUTER_PORT}/v1"
        self.state["base_urls"] = [
            f"http://{host_ip}:{ROUTER_PORT + i}/v1" for i in range(len(self.routers))
        ]
        self.state["admin_url"] = f"http://{cp_ip}:{ADMIN_PORT}"
        self._save()

    def _gpu_node(self, node: str) -> str:
        """NODE's fake H200 and its vLLM and Ray stand-ins (commands on its agent's PATH,
        each node's Ray state apart); returns the agent's config for them."""
        bindir = self.dir / f"bin-{node}"
        bindir.mkdir(exist_ok=True)
        ray_dir = self.dir / f"ray-{node}"
        for name, script, env in (
            ("nvidia-smi", FAKE_NVIDIA_SMI, ""),
            ("ray", STANDINS / "ray.py", f"RAY_STANDIN_DIR={ray_dir} "),
            ("vllm", STANDINS / "vllm.py", f"RAY_STANDIN_DIR={ray_dir} STANDIN_RAY_WAIT_S=50 "),
        ):
            path = bindir / name
            path.write_text(f'#!/bin/sh\n{env}exec "{sys.executable}" "{script}" "$@"\n')
            path.chmod(0o755)
        return (
            f'[discovery]\nnvidia_smi = "{bindir / "nvidia-smi"}"\n'
            '[inventory]\nfabric = "lab"\nengines = { vllm = "stand-in", ray = "stand-in" }\n'
        )

    def _argv(self, who: str) -> tuple[list[str], str | None]:
        """The command that runs ``who`` (cp, a router or a node) and its namespace."""
        llmgw = list(self.state.get("programs", {}).get(who, self.program))
        if who in self.routers:
            return [*llmgw, "router", "--config", f"{who}.toml"], None
        if who == "cp":
            return [*llmgw, "server", "--config", "server.toml"], self.state["cp"]["ns"]
        ns = self._node(who)["ns"]
        return [*llmgw, "agent", "--config", f"agent-{who}.toml"], ns

    def _start(self, who: str) -> int:
        argv, ns = self._argv(who)
        if ns is not None:  # its own network, and its own hostname: the node id
            argv = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                    f'hostname {who} && exec "$@"', "sh", *argv]  # fmt: skip
        env = {"PEX_ROOT": str(self.dir / "pex")}  # where a single file unpacks
        path = os.environ["PATH"]
        if who in self.node_names:
            # llama-server on the agent's PATH: a single file does not carry the Python
            # package it may come from here, and discovery looks on PATH first
            llama = find_llama_server()
            if llama is not None:
                path = f"{Path(llama).parent}:{path}"
        if self.gpus and who in self.node_names:  # its vLLM and Ray stand-ins
            path = f"{self.dir / f'bin-{who}'}:{path}"
        env["PATH"] = path
        if who in self.node_names:
            env.update(self.agent_env)
        # a session of its own: Ctrl-C reaches the lab, which tears down in order
        p = Proc(who, argv, self.dir, env=env, session=True).start()
        self._procs[p.pid] = p
        self.state["procs"][who] = p.pid
        self.state.setdefault("started", {})[str(p.pid)] = started(p.pid)
        self._save()
        return p.pid

    def _start_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._start("cp")
        token_file = self.dir / "state" / "admin-token"
        self._wait(
            lambda: token_file.exists() and fleetapi.up(self.admin_url),
            "the control plane",
            deadline,
        )
        for node in self.node_names:
            self._start(node)
        self._wait(
            lambda: (
                fleetapi.ready_nodes(self.admin_url, self.admin_token()) >= len(self.node_names)
            ),
            "every agent",
            deadline,
        )
        self._wait(lambda: self._serving() >= (2 if self.gpus else 1), "the models", deadline)
        for router, base_url in zip(self.routers, self.base_urls, strict=True):
            self._start(router)
            routes = functools.partial(fleetapi.served, base_url, self.key)
            self._wait(routes, f"{router} to route", deadline)

    def _wait(self, done: Callable[[], bool], what: str, deadline: float) -> None:
        while not done():
            for who, pid in self.state["procs"].items():
                if not alive(pid):
                    raise LabError(
                        f"{who} exited while waiting for {what}: see {self.dir / (who + '.log')}"
                    )
            if time.monotonic() > deadline:
                raise LabError(f"gave up waiting for {what}: see the logs in {self.dir}")
            time.sleep(0.2)

    def replicas(self) -> list[dict[str, Any]]:
        """The control plane's view of the replicas (``/v1/replicas``)."""
        return fleetapi.replicas(self.admin_url, self.admin_token())

    def set_replicas(self, replicas: int) -> None:
        """Every model of the catalog the lab starts with (one replica each) wanting
        ``replicas``, and the catalog reloaded, as ``ctl reload`` does."""
        catalog = self.dir / "catalog.toml"
        catalog.write_text(catalog.read_text().replace("replicas = 1", f"replicas = {replicas}"))
        r = httpx.post(
            self.admin_url + "/v1/catalog/reload",
            headers={"authorization": f"Bearer {self.admin_token()}"},
            timeout=10,
        )
        if r.status_code != 200:
            raise LabError(f"the catalog was not reloaded ({r.status_code}): {r.text}")

    def _serving(self) -> int:
        """How many models have a Ready replica."""
        try:
            return len({r["model"] for r in self.replicas() if r["state"] == "Ready"})
        except (httpx.HTTPError, OSError):
            return 0

    def nodes(self) -> list[dict[str, Any]]:
        """The control plane's view of the nodes (``/v1/nodes``)."""
        return fleetapi.nodes(self.admin_url, self.admin_token())

    def node_state(self, node: str) -> str | None:
        try:
            return next((n["state"] for n in self.nodes() if n["node_id"] == node), None)
        except (httpx.HTTPError, OSError):
            return None

    def wait_node(self, node: str, state: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.node_state(node)) != state:
            if time.monotonic() > deadline:
                raise LabError(f"{node} is {now}, not {state}, after {timeout:g} s")
            time.sleep(0.2)

    # -- faults -----------------------------------------------------------------

    def partition(self, node: str, *, drop: bool = False) -> None:
        """Cut NODE off: its link down (it sees no carrier), or with ``drop`` its link
        stays up and every packet is dropped both ways (unplugged from the bridge)."""
        n = self._node(node)
        if drop:  # with a wire on the link (netem without sch_netem), its TAP
            link = self.state.get("wires", {}).get(node, {}).get("tap", n["veth"])
            _run("ip", "link", "set", link, "nomaster")
        else:
            _run("ip", "link", "set", n["veth"], "down")

    def heal(self, node: str) -> None:
        """Undo partition and netem on NODE."""
        n = self._node(node)
        try:
            labwire.restore(self.state, node)  # before the veth goes back on the bridge
        finally:
            self._save()
        _run("tc", "qdisc", "del", "dev", n["veth"], "root", check=False)
        _run("ip", "netns", "exec", n["ns"], "tc", "qdisc", "del", "dev", "eth0", "root",
             check=False)  # fmt: skip
        _run("ip", "link", "set", n["veth"], "master", self.state["bridge"])
        _run("ip", "link", "set", n["veth"], "up")

    def netem(self, node: str, *, delay: str = "", loss: str = "") -> None:
        """Latency towards NODE (the round trip grows by ``delay``) and loss each way: by
        ``tc netem``, or where the kernel has no sch_netem by a userspace wire on the link
        (``labwire``)."""
        n = self._node(node)
        if not delay and not loss:
            raise LabError("netem: give --delay and/or --loss (e.g. --delay 200ms --loss 5%)")
        to_node = ["delay", delay] if delay else []
        lossy = ["loss", loss] if loss else []
        try:
            _run("tc", "qdisc", "replace", "dev", n["veth"], "root", "netem", *to_node, *lossy)
            if loss:
                _run("ip", "netns", "exec", n["ns"], "tc", "qdisc", "replace", "dev", "eth0",
                     "root", "netem", *lossy)  # fmt: skip
        except LabError as e:
            if "unknown" not in str(e):
                raise
            # no sch_netem in this kernel: the same in userspace, a wire on the link
            self._wire(node, delay=delay, loss=loss)

    def _wire(self, node: str, *, delay: str, loss: str) -> None:
        """netem's delay (towards NODE) and loss (each way) by ``labwire``."""
        m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s)?\s*", delay or "0")
        p = re.fullmatch(r"\s*([0-9.]+)\s*%?\s*", loss or "0")
        if m is None or p is None:
            raise LabError(
                f"netem: --delay {delay!r} --loss {loss!r}: e.g. --delay 200ms --loss 5%"
            )
        delay_ms = float(m[1]) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m[2] or "ms"]
        try:
            labwire.impair(self.state, node, 0.0, float(p[1]) / 100, self._note,
                           delay_back_ms=delay_ms, log=self.dir / f"wire-{node}.log")  # fmt: skip
        except labwire.WireError as e:
            raise LabError(f"netem: {e}") from None
        finally:
            self._save()

    def engine_pids(self, node: str, shard: str = "") -> list[int]:
        """The engines NODE's agent started (its records of them); ``shard``: only those
        of shards whose id starts so (a replica id, or a model's name)."""
        self._node(node)
        pids = []
        for record in (self.dir / f"agent-{node}").glob(f"shards/{shard}*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids.append(int(json.loads(record.read_text())["pid"]))
        return [p for p in pids if alive(p)]

    def kill(
        self, who: str, sig: str | int = "KILL", *, engine: bool = False, shard: str = ""
    ) -> list[int]:
        """Signal ``who`` (cp, router, a node's agent, or with ``engine`` its engines, or
        only those of shards whose id starts with ``shard``)."""
        num = _signal_number(sig)
        if engine:
            pids = self.engine_pids(who, shard)
            if not pids:
                raise LabError(f"{who} runs no engine now: see `ctl replicas`")
        else:
            if who not in self.state["procs"]:
                raise LabError(
                    f"no {who!r} in this lab: cp, router, or a node ({', '.join(self.state['nodes'])})"
                )
            pids = [self.state["procs"][who]]
            if not self._ours(pids[0]):
                raise LabError(f"{who} is not running: `tools/lab restart {who}` starts it")
        for pid in pids:
            if engine or self._ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, num)
        if num in (signal.SIGKILL, signal.SIGTERM):
            for pid in pids:
                self._reap(pid, 10)
        return pids

    def restart(self, who: str, program: list[str] | None = None) -> int:
        """Stop ``who`` (TERM, then KILL after 10 s) and start it again, same config;
        ``program``: run by that from now on (another llmgw: an upgrade)."""
        pid = self.state["procs"].get(who)
        if pid is None:
            raise LabError(
                f"no {who!r} in this lab: cp, router, or a node ({', '.join(self.state['nodes'])})"
            )
        self._stop(pid)
        if program is not None:
            self.state.setdefault("programs", {})[who] = list(program)
            self._save()
        return self._start(who)

    def fill_disk(self, node: str, *, free: bool = False) -> None:
        """Fill NODE's small-disk state dir (from ``up --small-disk NODE``), or free it."""
        state_dir = self.dir / f"agent-{node}"
        if str(state_dir) not in self.state.get("mounts", []):
            raise LabError(f"{node} has no small disk: `tools/lab up ... --small-disk {node}`")
        filler = state_dir / "lab-fill"
        if free:
            filler.unlink(missing_ok=True)
            return
        with contextlib.suppress(OSError), open(filler, "ab") as f:  # ENOSPC: full
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()

    # -- down -------------------------------------------------------------------

    def _reap(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        p = self._procs.get(pid)
        while time.monotonic() < deadline:
            if p is not None and p.returncode() is not None:
                return True
            if p is None and not alive(pid):
                return True
            time.sleep(0.05)
        return False

    def _ours(self, pid: int) -> bool:
        """Whether pid is still the process the lab started under that number."""
        recorded = self.state.get("started", {}).get(str(pid))
        return recorded is not None and recorded == started(pid)

    def _stop(self, pid: int) -> None:
        if not self._ours(pid):
            return  # gone, and its number may be another process's now
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
            if self._reap(pid, 10 if sig == signal.SIGTERM else 5):
                return

    def down(self) -> None:
        """Remove what the record says was made: processes, mounts, namespaces, links."""
        if not self.state and (self.dir / "lab.json").exists():
            self.state = json.loads((self.dir / "lab.json").read_text())
        with contextlib.suppress(labwire.WireError, OSError):  # a TAP left is a link below
            labwire.restore_all(self.state)
        procs: dict[str, int] = self.state.get("procs", {})
        # the routers and the agents first, the control plane last; in parallel, TERM then KILL
        routers = self.state.get("routers", ["router"])
        order = [w for w in (*routers, *self.state.get("nodes", {}), "cp") if w in procs]
        threads = [threading.Thread(target=self._stop, args=(procs[w],)) for w in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # whatever else runs in the lab's namespaces: engines, strays
        namespaces: list[str] = self.state.get("namespaces", [])
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [pid for ns in namespaces for pid in self._ns_pids(ns)]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while any(alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
        for mount in self.state.get("mounts", []):
            _run("umount", "--lazy", mount, check=False)
        for ns in namespaces:
            _run("ip", "netns", "del", ns, check=False)
        for link in self.state.get("links", []):
            if _run("ip", "link", "show", link, check=False).returncode == 0:
                _run("ip", "link", "del", link, check=False)
        left = [ns for ns in namespaces if Path(f"/run/netns/{ns}").exists()]
        left += [lk for lk in self.state.get("links", []) if Path(f"/sys/class/net/{lk}").exists()]
        if left:
            raise LabError(
                f"could not remove {', '.join(left)}: remove by hand (ip netns del / ip link del)"
            )
        for key in ("procs", "started", "namespaces", "links", "mounts"):
            self.state[key] = {} if key in ("procs", "started") else []
        if self.dir.exists():
            self._save()

    @staticmethod
    def _ns_pids(ns: str) -> list[int]:
        r = _run("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in r.stdout.split() if p.isdigit()]
