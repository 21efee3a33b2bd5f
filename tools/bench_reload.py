"""How long does a catalog reload hold the control plane's event loop?

Starts ONE real ``llmgw server`` (config, CA and certificates written to a
temporary folder, ports read from its log) and two real ``llmgw agent``
processes (heartbeat every 0.2 s, Unreachable after 2 s of silence), then, for
each catalog size asked for, writes a catalog of that many bytes (models that
want no replica, one per ~105 bytes) and runs ``POST /v1/catalog/reload``
while another thread asks the admin API's ``GET /healthz`` every 2 ms. The
admin API is served by the same event loop as the agent stream, so the
longest ``/healthz`` answer is the loop's longest stall, within a few ms.

For each size it prints: the reload's wall time (as ``ctl reload`` waits for
it), the longest ``/healthz`` wait from the reload to 3 s after it (the
reconcile passes over the new catalog included), and whether any node left
Ready.
A size over the bound (``catalog.MAX_CATALOG_BYTES``) is refused; the refusal
is timed the same way.

Everything runs on 127.0.0.1; every wait is bounded; the processes started
here are stopped on exit.

    python -m tools.bench_reload [--mib 0.5,2,3.9,5] [--after 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from llmgw.controlplane.catalog import MAX_CATALOG_BYTES
from llmgw.tls import init_ca, issue_agent, issue_server, load_ca
from tools.support.catalogs import catalog_of
from tools.support.procs import Failed, Proc, interrupt_on_sigterm, llmgw

HOST = "127.0.0.1"
NODES = ("b1", "b2")


SMALL = catalog_of(1)


def write_fleet(d: Path) -> None:
    pki = d / "pki"
    init_ca(pki, name="llmgw bench CA")
    ca = load_ca(pki)
    issue_server(ca, [HOST, "localhost"], pki)
    for node in NODES:
        issue_agent(ca, node, pki)
    (d / "catalog.toml").write_text(SMALL)
    (d / "server.toml").write_text(
        f"""state_dir = "state"
catalog = "catalog.toml"
[agent_stream]
listen = "{HOST}:0"
ca = "pki/ca.pem"
cert = "pki/server.pem"
key = "pki/server-key.pem"
[liveness]
heartbeat_interval_s = 0.2
unreachable_after_s = 2
lost_after_s = 30
[admin]
listen = "{HOST}:0"
[reconcile]
settle_s = 0
"""
    )


def agent_config(d: Path, node: str, port: int) -> Path:
    path = d / f"agent-{node}.toml"
    path.write_text(
        f"""control_plane = ["{HOST}:{port}"]
node_id = "{node}"
ca = "pki/ca.pem"
cert = "pki/{node}.pem"
key = "pki/{node}-key.pem"
state_dir = "agent-{node}"
[backoff]
initial_s = 0.1
max_s = 0.5
[discovery]
nvidia_smi = "/nonexistent"
"""
    )
    return path


class Prober:
    """Asks ``/healthz`` every 2 ms from a thread; keeps the longest answer per window."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.longest = 0.0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stopped.is_set():
                started = time.perf_counter()
                try:
                    client.get(self.url + "/healthz")
                except httpx.HTTPError:
                    pass
                took = time.perf_counter() - started
                with self.lock:
                    self.longest = max(self.longest, took)
                time.sleep(0.002)

    def take(self) -> float:
        with self.lock:
            longest, self.longest = self.longest, 0.0
        return longest


def run(sizes: list[float], after: float) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-reload-") as tmp:
        d = Path(tmp)
        write_fleet(d)
        procs: list[Proc] = []
        try:
            server = Proc("server", llmgw("server", "--config", "server.toml"), d, session=True)
            procs.append(server.start())
            port = int(server.wait_log(r"agent stream listening on [\d.]+:(\d+)")[1])
            admin = server.wait_log(r"admin API listening on (http://\S+)")[1]
            token = (d / "state" / "admin-token").read_text().strip()
            for node in NODES:
                config = agent_config(d, node, port)
                argv = llmgw("agent", "--config", config.name)
                procs.append(Proc(f"agent-{node}", argv, d, session=True).start())
            headers = {"authorization": f"Bearer {token}"}
            with httpx.Client(timeout=120, headers=headers) as client:
                deadline = time.monotonic() + 30
                while True:
                    nodes = client.get(admin + "/v1/nodes").json()["nodes"]
                    if sum(n["state"] == "Ready" for n in nodes) == len(NODES):
                        break
                    if time.monotonic() > deadline:
                        raise Failed(f"agents not Ready: {nodes}\n{server.log()[-2000:]}")
                    time.sleep(0.1)
                prober = Prober(admin)
                prober.thread.start()
                print(f"catalog bound: {MAX_CATALOG_BYTES / 2**20:g} MiB; heartbeat 0.2 s")
                print(
                    f"{'MiB':>5} {'models':>7} {'reload':>9} {'answer':<7}"
                    f" {'longest stall':>14}  nodes"
                )
                for mib in sizes:
                    text = catalog_of(int(mib * 2**20))
                    (d / "catalog.toml").write_text(text)
                    unreachable_before = server.log().count("is Unreachable")
                    time.sleep(0.5)
                    prober.take()
                    started = time.perf_counter()
                    r = client.post(admin + "/v1/catalog/reload")
                    took = time.perf_counter() - started
                    time.sleep(after)  # a stalled probe answers once the stall is over
                    stall = prober.take()
                    left = server.log().count("is Unreachable") - unreachable_before
                    print(
                        f"{mib:>5g} {text.count('[models.'):>7} {took * 1000:>7.0f}ms"
                        f" {r.status_code:<7} {stall * 1000:>12.0f}ms"
                        f"  {'stayed Ready' if left == 0 else f'{left} went Unreachable'}"
                    )
                    if r.status_code != 200:
                        print(f"      {r.json()['error']['message'][:160]}")
                    (d / "catalog.toml").write_text(SMALL)
                    client.post(admin + "/v1/catalog/reload")
                prober.stopped.set()
                prober.thread.join(5)
        finally:
            for p in reversed(procs):
                p.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="0.5,2,3.9,5", help="catalog sizes, MiB, comma-separated")
    parser.add_argument("--after", type=float, default=3.0, help="seconds watched after each")
    args = parser.parse_args()
    try:
        run([float(x) for x in args.mib.split(",")], args.after)
    except Failed as exc:
        print(f"bench_reload: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())
