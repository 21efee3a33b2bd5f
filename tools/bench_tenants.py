"""Tenants' limits across every router process, and a fair share of a full model.

One run starts two llama-servers of the tiny model, ``llmgw server`` routing to them
(its in-process router, with a queue: ``queue_timeout_s``), and two standalone
``llmgw router`` processes of two workers each, following it. Then, in turn:

- ``budgets``: T tenants, each with a budget of tokens a day, send N requests (of
  random ``max_tokens``) through random routers, many at once; at a third and two
  thirds of the run each standalone router is killed (SIGKILL) and started again.
  Reported: each tenant's tokens served past its budget (the goal: at most one lease
  and one request's ``max_tokens`` per killed router; by design, none), and the
  requests refused although their tenant's budget had room for them (false refusals:
  the tenant's final count, what the control plane counted as granted, left room for
  the refused request: the goal is 0).
- ``outage``: the control plane is killed for ``--outage-s``; the standalone routers
  keep serving from the leases they hold, then refuse saying so. Reported: requests
  served during the outage, and whether every refusal said the control plane could
  not be reached (none over a budget).
- ``fair``: a model of its own is full (two slow-model engines of one slot each,
  ``target_waiting`` 0, the router's queue); nine steady tenants send one stream at a
  time, and their time to first token is measured alone, then with a tenth sending
  ninety at once from a process of its own (so the clients that measure share no
  event loop with the load). The goal: their TTFT p95 with the noisy one at most
  1.2x without.
- ``cpu``: the in-process router's CPU per request, the same requests with a
  tenant's key (limits on) and with a config key (no tenant), side by side in six
  pairs, each in the other order from the last, the server on a core of its own
  (goal: the median ratio at most 1.1x).

    python -m tools.bench_tenants              # 50 tenants, 20,000 requests, ~10 min
    python -m tools.bench_tenants --quick      # 10 tenants, 1,500 requests, ~2 min
    python -m tools.bench_tenants --requests 100000   # the issue's size

Every loop is bounded in count and time; every process it starts is ended on the way
out (``Procs``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from llmgw.router.keys import hash_key, new_key
from tools.support.benchlib import cpu_seconds, free_port, percentile, pin, server_head
from tools.support.llama import start_servers
from tools.support.procs import Procs, interrupt_on_sigterm, llmgw
from tools.support.slowmodel import write_slow_model
from tools.support.tinymodel import write_model

HI = [{"role": "user", "content": "hi"}]


class Run:
    """The fleet of one run: where each router listens, and the admin API."""

    def __init__(self, procs: Procs, args: argparse.Namespace) -> None:
        self.procs = procs
        self.args = args
        self.dir = procs.workdir
        self.config_key = new_key()
        self.bases: list[str] = []  # in-process, router a, router b
        self.admin = ""
        self.token = ""

    def start(self) -> None:
        d = self.dir
        model = d / "tiny.gguf"
        write_model(model, ends_after=None, context_length=2048)
        options = ["--ctx-size", "2048", "--parallel", str(self.args.parallel)]
        options += ["--threads", "1", "--threads-batch", "1", "--metrics", "--slots"]
        urls = start_servers(self.procs, ["engine-a", "engine-b"], model, options)
        admin_port = free_port()
        catalog = _static("tiny", urls)
        if "fair" in self.args.only:  # a model the clients fill: one slot per engine
            slow = write_slow_model(d / "slow.gguf", context_length=2048)
            options = ["--ctx-size", "1024", "--parallel", "1", "--threads", "1",
                       "--threads-batch", "1", "--metrics", "--slots"]  # fmt: skip
            urls = start_servers(self.procs, ["slow-a", "slow-b"], slow, options)
            catalog += _static("slow", urls)
        (d / "catalog.toml").write_text(catalog)
        (d / "server.toml").write_text(
            server_head(d, f"127.0.0.1:{admin_port}")
            + f"""[router]
listen = "127.0.0.1:0"
queue_timeout_s = 30
access_log = {"true" if self.args.access_log else "false"}
[[router.keys]]
name = "config"
sha256 = "{hash_key(self.config_key)}"
"""
        )
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.start_server()
        self.token = (d / "state" / "admin-token").read_text().strip()
        for name in ("router-a", "router-b"):
            port = free_port()
            (d / f"{name}.toml").write_text(
                f'admin_url = "{self.admin}"\nadmin_token_file = "state/admin-token"\n'
                f'workers = 2\n[router]\nlisten = "127.0.0.1:{port}"\n'
            )
            self.bases.append(f"http://127.0.0.1:{port}/v1")
            self.start_router(name)

    def start_server(self) -> None:
        # a new ``Proc`` each start: it reads only what this start wrote to the log
        server = self.procs.start("server", llmgw("server", "--config", "server.toml"))
        m = server.wait_log(
            r"OpenAI-compatible endpoint on (http://127\.0\.0\.1:\d+/v1)", timeout=30
        )
        if not self.bases:
            self.bases.append(m[1])
        else:
            self.bases[0] = m[1]

    def start_router(self, name: str) -> None:
        """Start it (again), and wait until it serves both workers' routes."""
        proc = self.procs.start(name, llmgw("router", "--config", f"{name}.toml"))
        found = re.search(r'listen = "127\.0\.0\.1:(\d+)"', (self.dir / f"{name}.toml").read_text())
        assert found is not None
        port = int(found[1])
        proc.wait_until(lambda: _serves(port), "its endpoint answers /healthz", 30)
        time.sleep(1.0)  # both workers follow the routing (within a second)

    def kill(self, name: str) -> None:
        proc = self.procs.procs.pop(name)
        proc.signal_group(signal.SIGKILL)
        proc.popen.wait(5)

    def admin_call(self, method: str, path: str, body: object = None) -> Any:
        with httpx.Client(timeout=10) as c:
            r = c.request(
                method,
                self.admin + path,
                json=body,
                headers={"authorization": f"Bearer {self.token}"},
            )
            r.raise_for_status()
            return r.json()

    def tenant(self, name: str, limits: dict[str, int], weight: float = 1.0) -> str:
        self.admin_call("POST", "/v1/tenants", {"name": name, "limits": limits, "weight": weight})
        return str(self.admin_call("POST", "/v1/keys", {"tenant": name})["key"])


def _static(model: str, urls: list[str]) -> str:
    """The catalog entry of a model served by ``urls``, admitting nothing that would
    wait on an engine (the router queues it)."""
    quoted = ", ".join(f'"{u}"' for u in urls)
    return (
        f'[models.{model}]\nstatic_endpoints = [{quoted}]\nstatic_engine = "llama.cpp"\n'
        f"[models.{model}.routing]\ntarget_waiting = 0\n"
    )


def _serves(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def request_body(max_tokens: int, stream: bool = False, model: str = "tiny") -> bytes:
    body = {"model": model, "messages": HI, "max_tokens": max_tokens, "stream": stream}
    return json.dumps(body).encode()


def reservation(max_tokens: int) -> int:
    """What a router reserves for such a request (``router.quota``): its body's bytes
    over three, plus one, plus its max_tokens."""
    return len(request_body(max_tokens)) // 3 + 1 + max_tokens


async def chat(
    client: httpx.AsyncClient,
    base: str,
    key: str,
    max_tokens: int,
    stream: bool = False,
    model: str = "tiny",
) -> tuple[int, dict[str, Any], float | None]:
    """(status, body or error, time to first token for a stream)."""
    body = request_body(max_tokens, stream, model)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    started = trio.current_time()
    try:
        if not stream:
            r = await client.post(base + "/chat/completions", content=body, headers=headers)
            return r.status_code, r.json(), None
        ttft = None
        async with client.stream(
            "POST", base + "/chat/completions", content=body, headers=headers
        ) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.json(), None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data:"):
                    ttft = trio.current_time() - started
            return 200, {}, ttft
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return 0, {"error": {"message": str(exc)}}, None


# --------------------------------------------------------------------------- budgets


async def budgets(run: Run, tenants: int, requests: int, budget: int) -> dict[str, Any]:
    keys = {f"b{i}": run.tenant(f"b{i}", {"budget_day": budget}) for i in range(tenants)}
    await trio.sleep(1.0)  # the tenants reach every router
    served = dict.fromkeys(keys, 0)
    refused: list[tuple[str, int]] = []  # (tenant, the request's reservation)
    other: dict[str, int] = {}
    sent = 0
    rng = random.Random(7)
    kills = {requests // 3: "router-a", 2 * requests // 3: "router-b"}

    async def one(client: httpx.AsyncClient, tenant: str, base: str, max_tokens: int) -> None:
        status, body, _ = await chat(client, base, keys[tenant], max_tokens)
        if status == 200:
            served[tenant] += int(body["usage"]["total_tokens"])
        elif status == 429 and body["error"].get("code") == "insufficient_quota":
            refused.append((tenant, reservation(max_tokens)))
        else:
            why = f"{status} {str(body.get('error', {}).get('message', ''))[:60]}"
            other[why] = other.get(why, 0) + 1

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:
        room = trio.Semaphore(32)  # requests at once

        async def limited(tenant: str, base: str, max_tokens: int) -> None:
            try:
                await one(client, tenant, base, max_tokens)
            finally:
                room.release()

        async with trio.open_nursery() as nursery:
            while sent < requests:
                if sent in kills:
                    name = kills[sent]
                    run.kill(name)  # with its leases
                    await trio.to_thread.run_sync(run.start_router, name)
                await room.acquire()
                tenant = rng.choice(list(keys))
                nursery.start_soon(limited, tenant, rng.choice(run.bases), rng.randint(1, 24))
                sent += 1
    took = time.monotonic() - started
    over = {t: served[t] - budget for t in keys if served[t] > budget}
    counted = {t: run.admin_call("GET", f"/v1/tenants/{t}")["counted"]["budget_day"] for t in keys}
    false = [(t, r) for t, r in refused if counted[t] + r <= budget]
    return {
        "tenants": tenants,
        "requests": requests,
        "seconds": round(took, 1),
        "tokens_served": sum(served.values()),
        "tenants_over_budget": len(over),
        "tokens_past_budgets": sum(over.values()),
        "refused_insufficient_quota": len(refused),
        "false_refusals": len(false),
        "lost_to_kills": sum(counted[t] - served[t] for t in keys),
        "other_answers": other,
    }


# --------------------------------------------------------------------------- outage


async def outage(run: Run, outage_s: float) -> dict[str, Any]:
    key = run.tenant("steady", {"budget_day": 10**9, "rpm": 100_000})
    await trio.sleep(1.0)
    edge = run.bases[1]
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(50):  # busy: the router holds leases ahead of need
            await chat(client, edge, key, 4)
        run.kill("server")
        served = refused = 0
        said: dict[str, int] = {}
        end = trio.current_time() + outage_s
        while trio.current_time() < end:
            status, body, _ = await chat(client, edge, key, 4)
            if status == 200:
                served += 1
            else:
                refused += 1
                message = str(body.get("error", {}).get("message", ""))
                kind = "cannot ask for more" if "cannot ask for more" in message else message[:60]
                said[kind] = said.get(kind, 0) + 1
                await trio.sleep(0.2)
        run.start_server()
        await trio.sleep(2.0)
    return {"outage_s": outage_s, "served": served, "refused": refused, "refusals_said": said}


# --------------------------------------------------------------------------- fair


async def fairness(run: Run, rounds: int) -> dict[str, Any]:
    """The steady tenants' TTFT on the full ``slow`` model, alone, then with the noisy
    tenant's 90 streams at once sent by a process of its own (``noisy``), so the
    clients that measure share no event loop with the load."""
    steady = {f"s{i}": run.tenant(f"s{i}", {}) for i in range(9)}
    noisy = run.tenant("noisy", {})
    await trio.sleep(1.0)
    base = run.bases[0]  # the in-process router, with its queue

    async def measure(with_noisy: bool) -> list[float]:
        ttfts: list[float] = []
        if with_noisy:
            spec = {"base": base, "key": noisy, "streams": 90, "for_s": 120}
            argv = llmgw("--noisy", json.dumps(spec), module="tools.bench_tenants")
            run.procs.start("noisy", argv)  # this Python: the checkout is on its path
            await trio.sleep(3.0)  # the model is full, and the noisy one has used tokens
        try:
            async with httpx.AsyncClient(timeout=60) as c:

                async def steady_client(key: str) -> None:
                    for _ in range(rounds):
                        status, _, ttft = await chat(c, base, key, 16, True, "slow")
                        if status == 200 and ttft is not None:
                            ttfts.append(ttft)

                async with trio.open_nursery() as nursery:
                    for key in steady.values():
                        nursery.start_soon(steady_client, key)
        finally:
            if with_noisy:
                noisy_ended = run.procs.procs.pop("noisy")
                noisy_ended.signal_group(signal.SIGTERM)
                noisy_ended.popen.wait(10)
        return ttfts

    alone = await measure(False)
    shared = await measure(True)
    p_alone, p_shared = percentile(alone, 0.95), percentile(shared, 0.95)
    ratio = p_shared / p_alone if p_alone and p_shared else None
    return {
        "steady_requests": [len(alone), len(shared)],
        "ttft_p95_alone_s": p_alone,
        "ttft_p95_with_noisy_s": p_shared,
        "ratio": ratio,
        "goal": "met" if ratio is not None and ratio <= 1.2 else "NOT met",
    }


def noisy_load(spec: dict[str, Any]) -> None:
    """``spec["streams"]`` streams at once, one after another each, for ``for_s`` at
    most (or until SIGTERM): the noisy tenant of ``fair``, in a process of its own."""

    async def load() -> None:
        limits = httpx.Limits(max_connections=spec["streams"] + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:

            async def one() -> None:
                while True:
                    await chat(c, spec["base"], spec["key"], 16, True, "slow")

            with trio.move_on_after(spec["for_s"]):
                async with trio.open_nursery() as nursery:
                    for _ in range(spec["streams"]):
                        nursery.start_soon(one)

    trio.run(load)


# --------------------------------------------------------------------------- cpu


async def cpu(run: Run, requests: int, pairs: int = 6) -> dict[str, Any]:
    """The server's CPU per request, with a tenant's key (limits on) and with a config
    key, ``pairs`` times side by side (each pair in the other order from the last, so
    that a drift in what else the machine does falls on both alike): the median of the
    pairs' ratios.

    The server runs on a core of its own meanwhile, and everything else (the engines,
    the routers, this client) on the others, as ``bench_router`` measures the router:
    on two cores shared by five busy processes, a process's CPU time per request
    varies by 10 to 20 % between runs of the same key with what ran beside it on the
    same core (its caches), which hides a difference of a few per cent."""
    key = run.tenant("cpu", {"rpm": 10**6, "tpm": 10**9, "in_flight": 1000})
    await trio.sleep(1.0)
    pid = run.procs["server"].pid
    cores = os.sched_getaffinity(0)
    pinned = len(cores) >= 2
    if pinned:
        own = min(cores)
        pin(pid, {own})
        for name, proc in run.procs.procs.items():
            if name != "server":
                pin(proc.pid, cores - {own})
        os.sched_setaffinity(0, cores - {own})
    base = run.bases[0]
    spent: dict[str, list[float]] = {"tenant": [], "config": []}
    try:
        async with httpx.AsyncClient(timeout=30) as client:

            async def measure(k: str) -> float:
                before = cpu_seconds(pid)
                async with trio.open_nursery() as nursery:
                    for _ in range(8):

                        async def loop() -> None:
                            for _ in range(requests // 8):
                                await chat(client, base, k, 2)

                        nursery.start_soon(loop)
                return (cpu_seconds(pid) - before) / requests * 1e3

            await measure(run.config_key)  # warm: connections, the engines' caches
            for i in range(pairs):
                order = [("tenant", key), ("config", run.config_key)]
                for label, k in order if i % 2 == 0 else order[::-1]:
                    spent[label].append(await measure(k))
    finally:
        if pinned:
            for proc in run.procs.procs.values():
                pin(proc.pid, cores)
            os.sched_setaffinity(0, cores)
    ratios = sorted(t / c for t, c in zip(spent["tenant"], spent["config"], strict=True))
    ratio = statistics.median(ratios)
    return {
        "router_cpu_ms_per_request_tenant": round(sum(spent["tenant"]) / pairs, 3),
        "router_cpu_ms_per_request_config": round(sum(spent["config"]) / pairs, 3),
        "server_core": "own" if pinned else "shared (one CPU)",
        "pair_ratios": [round(r, 3) for r in ratios],
        "ratio": round(ratio, 3),
        "goal": "met" if ratio <= 1.1 else "NOT met",
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tenants", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None, help="tokens a day per tenant")
    ap.add_argument("--outage-s", type=float, default=None)
    ap.add_argument("--parallel", type=int, default=4, help="slots per engine")
    ap.add_argument("--only", default="budgets,outage,fair,cpu")
    ap.add_argument("--access-log", action="store_true", help="the server's, in its log")
    ap.add_argument("--noisy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.noisy:
        noisy_load(json.loads(args.noisy))
        return
    quick = args.quick
    tenants = args.tenants or (10 if quick else 50)
    requests = args.requests or (1500 if quick else 20_000)
    # about two thirds of the requests fit the budgets: the rest find them spent
    budget = args.budget or int(requests / tenants * 28 * 2 / 3)
    outage_s = args.outage_s or (10.0 if quick else 60.0)
    interrupt_on_sigterm()
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-tenants-") as tmp:
        procs = Procs(Path(tmp))
        try:
            run = Run(procs, args)
            run.start()
            results: dict[str, Any] = {}
            if "budgets" in only:
                results["budgets"] = trio.run(budgets, run, tenants, requests, budget)
                print("budgets", json.dumps(results["budgets"]), flush=True)
            if "outage" in only:
                results["outage"] = trio.run(outage, run, outage_s)
                print("outage", json.dumps(results["outage"]), flush=True)
            if "cpu" in only:
                results["cpu"] = trio.run(cpu, run, 400 if quick else 1600)
                print("cpu", json.dumps(results["cpu"]), flush=True)
            if "fair" in only:
                results["fair"] = trio.run(fairness, run, 4 if quick else 10)
                print("fair", json.dumps(results["fair"]), flush=True)
            b = results.get("budgets")
            if b:
                print(
                    f"\nbudgets: {b['tokens_past_budgets']} tokens served past budgets "
                    f"({b['tenants_over_budget']} tenants over; goal: within a lease per "
                    f"killed router: {'met' if b['tokens_past_budgets'] == 0 else 'see above'}), "
                    f"{b['false_refusals']} false refusals (goal 0: "
                    f"{'met' if b['false_refusals'] == 0 else 'NOT met'}), "
                    f"{b['lost_to_kills']} tokens of leases lost with the killed routers"
                )
            if "outage" in results:
                o = results["outage"]
                print(
                    f"outage: {o['served']} served from leases in {o['outage_s']:g} s, "
                    f"{o['refused']} refused: {o['refusals_said']}"
                )
            if "cpu" in results:
                print(
                    f"cpu: tenants on / off = {results['cpu']['ratio']} ({results['cpu']['goal']})"
                )
            if "fair" in results:
                f = results["fair"]
                print(f"fair: steady TTFT p95 with noisy / without = {f['ratio']} ({f['goal']})")
        finally:
            procs.stop_all()


if __name__ == "__main__":
    main()
