"""Run a whole local fleet on this machine: CA, control plane, agents, and a real model.

Run by ``tools/fleet`` (the README's first command). Everything lives under
``--dir`` (default ``.llmgw/fleet``) and is reused on the next run: the CA is
made once, like a real installation's.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from llmgw.admin.views import NodeView, ReplicaView
from llmgw.cli.render import render_nodes, render_replicas
from llmgw.router.keys import hash_key, new_key
from llmgw.tls import init_ca, issue_agent, issue_server, load_ca
from tools.support import fleetapi
from tools.support.catalogs import write_tiny_catalog
from tools.support.procs import Proc, llmgw, stop_engines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path(".llmgw/fleet"))
    parser.add_argument("--agents", type=int, default=1, help="how many agents (default 1)")
    parser.add_argument("--stream-port", type=int, default=7443)
    parser.add_argument("--admin-port", type=int, default=7444)
    parser.add_argument("--router-port", type=int, default=8000)
    parser.add_argument("--console-port", type=int, default=7445, help="the web console's")
    parser.add_argument(
        "--engine-ports",
        type=int,
        default=20000,
        metavar="LOW",
        help="agent i's engines listen on LOW+100i .. LOW+100i+99 (default 20000)",
    )
    parser.add_argument(
        "--check", action="store_true", help="start, wait until every node is Ready, stop"
    )
    args = parser.parse_args()
    d: Path = args.dir.resolve()
    d.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    nodes = [host] if args.agents == 1 else [f"{host}-{i}" for i in range(1, args.agents + 1)]

    pki = d / "pki"
    if not (pki / "ca.pem").exists():
        init_ca(pki)
    ca = load_ca(pki)
    if not (pki / "server.pem").exists():
        issue_server(ca, ["127.0.0.1", "::1", "localhost"], pki)
    for node in nodes:
        if not (pki / f"{node}.pem").exists():
            issue_agent(ca, node, pki)

    write_tiny_catalog(d)
    key_file = d / "api-key"
    if not key_file.exists():
        key_file.write_text(new_key() + "\n")
        key_file.chmod(0o600)
    api_key = key_file.read_text().strip()
    (d / "server.toml").write_text(
        f"""state_dir = "state"
catalog = "catalog.toml"
[router]
listen = "127.0.0.1:{args.router_port}"
[[router.keys]]
name = "local"
sha256 = "{hash_key(api_key)}"
[reconcile]
settle_s = 1
[agent_stream]
listen = "127.0.0.1:{args.stream_port}"
[admin]
listen = "127.0.0.1:{args.admin_port}"
[console]
listen = "127.0.0.1:{args.console_port}"
"""
    )
    low = args.engine_ports
    for node in nodes:
        i = nodes.index(node)
        (d / f"agent-{node}.toml").write_text(
            f'control_plane = ["127.0.0.1:{args.stream_port}"]\n'
            f'node_id = "{node}"\nstate_dir = "agent-{node}"\n'
            # agents on one machine: each its own engine ports
            f"[engines]\nport_range = [{low + 100 * i}, {low + 99 + 100 * i}]\n"
        )

    # their logs on this terminal; Ctrl-C reaches them as it reaches this command
    server = Proc("server", llmgw("server", "--config", "server.toml"), d, output="terminal")
    procs = [server.start()]
    try:
        token_file = d / "state" / "admin-token"
        url = f"http://127.0.0.1:{args.admin_port}"
        _wait(lambda: token_file.exists() and fleetapi.up(url), "the control plane to start", procs)
        for node in nodes:
            argv = llmgw("agent", "--config", f"agent-{node}.toml")
            procs.append(Proc(f"agent-{node}", argv, d, output="terminal").start())
        token = token_file.read_text().strip()
        _wait(
            lambda: fleetapi.ready_nodes(url, token) >= len(nodes),
            "every agent to register",
            procs,
        )
        views = msgspec.convert(fleetapi.nodes(url, token), list[NodeView])
        print("\n" + render_nodes(views, time.time()), flush=True)
        _wait(lambda: _ready_replica(url, token) is not None, "the model to be served", procs, 180)
        replica = _ready_replica(url, token)
        assert replica is not None
        print(render_replicas([msgspec.convert(replica, ReplicaView)]), flush=True)
        base = f"http://127.0.0.1:{args.router_port}/v1"
        _wait(lambda: fleetapi.served(base, api_key), "the router to route to it", procs, 30)
        print(
            f"\nlocal fleet is up: {len(nodes)} agent(s), model 'tiny' served by llama-server"
            f"\n  base URL: {base}"
            f"\n  API key:  {api_key}"
            f"\n  python: OpenAI(base_url={base!r}, api_key={api_key!r})"
            f"\n             .chat.completions.create(model='tiny', messages=[...])"
            f"\n  curl {base}/chat/completions -H 'authorization: Bearer {api_key}' "
            """-H 'content-type: application/json' """
            """-d '{"model":"tiny","messages":[{"role":"user","content":"hi"}]}'"""
            f"\n  .venv/bin/llmgw ctl nodes --config {d / 'server.toml'}"
            f"\n  .venv/bin/llmgw ctl replicas --config {d / 'server.toml'}"
            f"\n  web console: http://127.0.0.1:{args.console_port}/ (viewer token in"
            f" {d / 'state' / 'console-viewer-token'}, admin token in {token_file})"
            f"\n  logs above; Ctrl-C stops everything\n",
            flush=True,
        )
        if args.check:
            from openai import OpenAI

            client = OpenAI(base_url=base, api_key=api_key)
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
            print("check: the model answered:", reply.choices[0].message.content, flush=True)
        if not args.check:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            while not stop.wait(0.5):
                if not all(p.running() for p in procs):
                    print("fleet: a daemon exited; stopping the rest", file=sys.stderr)
                    break
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop(None)  # SIGKILL for one that has not exited within 5 s
        stop_engines(d)
    return 0


def _ready_replica(url: str, token: str) -> dict[str, Any] | None:
    try:
        replicas = fleetapi.replicas(url, token)
    except httpx.HTTPError:
        return None
    return next((r for r in replicas if r["state"] == "Ready"), None)


def _wait(done: Callable[[], bool], what: str, procs: list[Proc], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        for p in procs:
            if not p.running():
                raise SystemExit(f"fleet: {' '.join(p.argv)} exited ({p.returncode()})")
        if time.monotonic() > deadline:
            raise SystemExit(f"fleet: gave up waiting for {what} after {timeout:g} s")
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
