"""Is the web console quick enough, and what does a room of open consoles cost the server?

Starts ONE real ``llmgw server`` (config and catalog written to a temporary folder,
``[console] listen = "127.0.0.1:0"``, ports read from its log) and the agents
benchmark's simulated fleet (``tools.bench_agents``' worker processes: real TLS,
WebSocket and protocol, one client certificate per node), told to obey the control
plane: every StartShard is answered ``starting`` then ``ready`` over the same
session, every StopShard ``stopped``. The catalog wants ``--models`` models of
``--replicas`` replicas each, every one a 1-GPU llama.cpp profile whose
``model_path`` some of the nodes report in their weights (each node ten models'),
so that 200 nodes of 8 simulated GPUs run 1,000 Ready replicas. Once
``/v1/replicas`` says they all are, it measures, with the goals of the issue:

1. the first page load: a headless Chromium (Debian's, driven through Selenium and
   its chromedriver; nothing downloaded), signed in as the admin through the page's
   form (``input#token``, ``button#signin-button``), then reloads ``/#/fleet``; a
   MutationObserver injected before the page's scripts run (CDP
   ``Page.addScriptToEvaluateOnNewDocument``) records ``performance.now()`` (from
   the navigation's start) when ``body[data-rendered]`` is set with every node's
   row and every model's row in the tables, and at the next animation frame
   (painted: the goal's figure). Each sample reloads the page. Cold: the browser's
   cache emptied first (CDP ``Network.clearBrowserCache``; the session stays);
   warm: with the cache. Goal: 1 s. Also shown: from the sign-in button to the
   fleet painted;
2. the console API's latency: one client (httpx, keep-alive, signed in as the
   viewer) asks each of ``/api/nodes``, ``/api/models``, ``/api/replicas``,
   ``/api/traffic`` and ``/api/models/M/placement`` (M going round the models)
   ``--requests`` times in a row, whole body read; p50, p99, max, the body's size
   and the server's CPU per request; also the control plane's reconcile passes
   meanwhile (they hold the same event loop), and with ``--gc-log`` the server's
   full garbage collections (a sitecustomize on its PYTHONPATH logs them; its code
   is untouched). Goal: p99 50 ms each;
3. a change on screen: with the fleet page open, a node is cordoned through the
   admin API (``POST /v1/nodes/NODE {"intent": "cordon"}``), the wall clock read
   just before; the page's MutationObserver records ``performance.timeOrigin +
   performance.now()`` when ``tr[data-node=NODE] td.intent`` reads "cordoned"
   (and at the next frame); then uncordoned, the same way. Same machine, same
   clock. And a node going Unreachable: agents are silenced (their connection kept
   open), and the lateness is from the server's own log line ``node X is
   Unreachable`` (its millisecond timestamp) to the page's ``td.state`` reading
   "Unreachable". Goal: 1 s;
4. the server's CPU (``benchlib.cpu_seconds``: the scheduler's per-thread account
   in /proc/<pid>/task/*/schedstat, /proc/<pid>/stat's utime+stime where that is
   missing; % of one core) over a ``--window`` with a cordon or uncordon through
   the admin API every ``--change-every`` seconds (so the live feed has changes to
   carry), first with no console open, then with ten signed-in consoles on the
   fleet page, live. Each console is its own headless Chromium by default
   (``--consoles-in browsers``): tabs of one Chromium share its six connections to
   the console's origin (HTTP/1.1), and each open page holds one for its live feed,
   so with six tabs open no page's fetch gets a connection (each still says "live",
   and none changes again) and a seventh does not load; ``--consoles-in tabs``
   shows it (five tabs work). The issue sets no figure: it is reported beside the
   window without consoles, and every console must have shown every change (else
   the figure is not what it says).

A note on Chromium: a page navigated away from (not reloaded, not closed) is kept in
its back/forward cache, and the console's page keeps its live feed open there; the
sixth such page holds the last of the six connections Chromium keeps to one origin,
and the console no longer loads in that browser. So the loads here are reloads, and
the consoles never navigate away.

The table prints each measure, its goal and what was measured; the exit status is 0
when every goal is met, 1 otherwise (or when the benchmark could not run), 130 on
Ctrl-C. Also printed: what the server logged in each window (a flood shows), its
WARNING/ERROR lines, and the pages' console errors.

``--quick``: 50 nodes, 10 models x 20 replicas (200), heartbeat 1 s, fewer samples,
10 s windows; under a minute and a half. The full run takes about three minutes on
2 cores.

Everything runs on 127.0.0.1; every wait is bounded; every process started here
(server, agent workers, chromedrivers and their Chromiums) is stopped on exit,
Ctrl-C and SIGTERM included.

    python -m tools.bench_console [--quick] [--nodes 200] [--models 50] [--replicas 20]
        [--requests 300] [--loads 5] [--changes 10] [--unreachable 3] [--window 30]
        [--change-every 3] [--consoles 10] [--consoles-in browsers|tabs]
        [--heartbeat 5] [--unreachable-after 15] [--workers 2] [--keep-logs] [--gc-log]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tools.bench_agents import (
    Admin,
    Fleet,
    WorkerProc,
    _pdeathsig,
    bucket_quantile,
    ensure_pki,
    histogram,
    node_name,
    raise_nofile,
)
from tools.bench_agents import write_config as agents_config
from tools.support.benchlib import cpu_seconds, percentile, tree_cpu
from tools.support.chromium import CHROMEDRIVER, CHROMIUM
from tools.support.chromium import FLAGS as CHROME_FLAGS
from tools.support.procs import Failed, Proc, interrupt_on_sigterm, llmgw

try:
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service
except ModuleNotFoundError:  # said by browser_missing(), and the benchmark does not start
    pass

HOST = "127.0.0.1"
FLAGS = (*CHROME_FLAGS, "--window-size=1280,800")
# tabs mode: background tabs would otherwise have their timers and rendering throttled
TAB_FLAGS = (
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
)
GOAL_LOAD_S = 1.0
GOAL_API_P99_S = 0.050
GOAL_CHANGE_S = 1.0
WEIGHTS_PER_NODE = 10  # models whose weights each node reports
WEIGHTS_DIR = "/models"
ENDPOINTS = ("nodes", "models", "replicas", "traffic", "placement")

# Injected before the page's scripts (every document of the tab): when the fleet is
# first rendered whole, in ms from the navigation's start; painted: the next frame.
WATCH_LOAD = """
(() => {
  const want = {nodes: %(nodes)d, models: %(models)d};
  const b = window.__bench = {rendered: null, painted: null, calls: 0, clicked: null};
  const fetch0 = window.fetch;
  window.fetch = function (...args) { b.calls++; return fetch0.apply(this, args); };
  const check = () => {
    if (b.rendered !== null || !document.body || document.body.dataset.rendered === undefined)
      return;
    const n = document.querySelectorAll('table#nodes tbody tr[data-node]').length;
    const m = document.querySelectorAll('table#models tbody tr[data-model]').length;
    if (n < want.nodes || m < want.models) return;
    b.rendered = performance.now();
    requestAnimationFrame(() => { b.painted = performance.now(); });
  };
  new MutationObserver(check).observe(document, {subtree: true, childList: true,
    attributes: true, attributeFilter: ['data-rendered']});
})();
"""

# Armed on an open fleet page: for each node, the wall clock (ms) when its row's cell
# first reads (or stops reading) a word, and at the next frame.
WATCH_CELLS = """
const [cell, watches] = arguments;
window.__seen = {};
if (window.__watch) window.__watch.disconnect();
const look = () => {
  for (const [node, word, has] of watches) {
    if (window.__seen[node]) continue;
    const td = document.querySelector(`table#nodes tr[data-node="${node}"] td.${cell}`);
    if (!td || td.textContent.includes(word) !== has) continue;
    const seen = window.__seen[node] = {dom: performance.timeOrigin + performance.now()};
    requestAnimationFrame(() => { seen.painted = performance.timeOrigin + performance.now(); });
  }
};
window.__watch = new MutationObserver(look);
window.__watch.observe(document.body, {subtree: true, childList: true, characterData: true});
look();
return Object.keys(window.__seen).length;
"""


def browser_missing() -> str:
    """ "" when Chromium, chromedriver and Selenium are there, else what to install."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if "webdriver" not in globals():
        missing.append("selenium (.venv/bin/pip install -e '.[test]')")
    return ", ".join(missing)


# =========================================================================== the browser


class Chrome:
    """One headless Chromium with its own profile in a temporary folder, driven by its
    own chromedriver (in a session of its own: Ctrl-C reaches this process only, which
    quits it). ``quit`` ends both, by force if need be, and removes the folder."""

    def __init__(self, workdir: Path, name: str, *, tabs: bool = False) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"chromium-{name}-", dir=workdir))
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in FLAGS + (TAB_FLAGS if tabs else ()):
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.dir / 'profile'}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        if tabs:  # a tab whose page cannot load must not hold every later call
            options.page_load_strategy = "none"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            options.ignore_local_proxy_environment_variables()
        self.service = Service(
            executable_path=str(CHROMEDRIVER),
            log_output=str(self.dir / "chromedriver.log"),
            popen_kw={"start_new_session": True},
        )
        self.driver: Any = None
        self._log: list[dict[str, Any]] = []
        try:
            self.driver = webdriver.Chrome(options=options, service=self.service)
        except WebDriverException as exc:
            log = self.dir / "chromedriver.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            self.quit()
            raise Failed(
                f"Chromium did not start: {exc.msg}\nchromedriver's log ends:\n{tail}"
            ) from None
        self.driver.command_executor.client_config.timeout = 60
        self.driver.set_page_load_timeout(30)
        self.driver.set_script_timeout(5 if tabs else 30)

    @property
    def pid(self) -> int | None:
        proc = getattr(self.service, "process", None)
        return None if proc is None else int(proc.pid)

    def cpu(self) -> float:
        """CPU time of chromedriver and every Chromium process under it."""
        return 0.0 if self.pid is None else tree_cpu(self.pid)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def cdp(self, cmd: str, params: dict[str, Any] | None = None) -> Any:
        return self.driver.execute_cdp_cmd(cmd, params or {})

    def wait_js(self, expr: str, timeout: float, what: str, *args: Any) -> Any:
        """The value of ``return EXPR`` once truthy, polled every 50 ms for ``timeout``
        seconds; else ``Failed`` saying what was awaited and what the page shows. (The
        figures are the page's own clock readings: polling only finds them.)"""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(f"return {expr};", *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise Failed(f"{self.name}: no {what} after {timeout:g} s; {self.describe()}")
            time.sleep(0.05)

    def describe(self) -> str:
        with contextlib.suppress(Exception):
            text = " ".join(str(self.js("return document.body.innerText")).split())
            return f"the page {self.driver.current_url} shows {text[:400]!r}"
        return "the page could not be read"

    def errors(self) -> list[str]:
        """The SEVERE console entries since it started."""
        with contextlib.suppress(Exception):
            self._log.extend(self.driver.get_log("browser"))
        return [e["message"] for e in self._log if e.get("level") == "SEVERE"]

    def sign_in_by_form(self, url: str, token: str) -> None:
        """The sign-in form, as a person uses it (the page at ``/``, no session yet)."""
        self.driver.get(url + "/")
        self.wait_js("document.querySelector('input#token')", 15, "sign-in form")
        field_ = self.driver.find_element("css selector", "input#token")
        field_.clear()
        field_.send_keys(token)
        self.js("window.__bench && (window.__bench.clicked = performance.now())")
        self.driver.find_element("css selector", "button#signin-button").click()

    def quit(self) -> None:
        if self.driver is not None:
            with contextlib.suppress(Exception):
                self.driver.quit()
            self.driver = None
        proc = getattr(self.service, "process", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(5)
        if proc is not None:  # its Chromiums, if chromedriver left any
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def fleet_watch(browser: Chrome, nodes: int, models: int) -> None:
    """The load watcher on every document this tab opens from now on."""
    source = WATCH_LOAD % {"nodes": nodes, "models": models}
    browser.cdp("Page.addScriptToEvaluateOnNewDocument", {"source": source})


def reload_fleet(browser: Chrome, timeout: float = 30) -> dict[str, Any]:
    """Reload the fleet page (a new document) and wait until the watcher saw it rendered
    whole and painted; its figures. A reload, not a navigation to it from elsewhere: a
    page navigated away from stays in Chromium's back/forward cache with its live feed
    open (see the note in the module docstring), and the sixth would take the last of
    the six connections Chromium opens to one origin."""
    browser.driver.refresh()
    browser.wait_js(
        "window.__bench && window.__bench.painted !== null", timeout, "fleet rendered whole"
    )
    return dict(
        browser.js(
            """
            const nav = performance.getEntriesByType('navigation')[0] || {};
            const api = {};
            for (const e of performance.getEntriesByType('resource'))
              if (e.name.includes('/api/')) api[new URL(e.name).pathname] = e.duration;
            return {rendered: window.__bench.rendered, painted: window.__bench.painted,
                    dcl: nav.domContentLoadedEventEnd || null, api};
            """
        )
    )


# =========================================================================== the fleet


def catalog_text(models: int, replicas: int) -> str:
    out = []
    for m in range(models):
        name = model_name(m)
        out.append(
            f"""[models.{name}]
replicas = {replicas}
[[models.{name}.profiles]]
name = "h100"
engine = "llama.cpp"
gpus = 1
min_memory_gb = 16
model_path = "{WEIGHTS_DIR}/{name}.gguf"
settings = {{ context = 8192, parallel = 4 }}
startup_timeout_s = 600
"""
        )
    return "\n".join(out)


def model_name(m: int) -> str:
    return f"chat-{m:02d}"


def weights_of(nodes: int, models: int) -> dict[str, list[list[str]]]:
    """Node i holds the weights of models i, i+1, ... (ten of them, round the catalog):
    each model's on about nodes * 10 / models nodes."""
    k = min(WEIGHTS_PER_NODE, models)
    return {
        node_name(i): [
            [model_name((i + j) % models), f"{WEIGHTS_DIR}/{model_name((i + j) % models)}.gguf"]
            for j in range(k)
        ]
        for i in range(nodes)
    }


def write_config(workdir: Path, pki: Path, p: Params) -> Path:
    (workdir / "catalog.toml").write_text(catalog_text(p.models, p.replicas))
    more = f'catalog = "catalog.toml"\n[reconcile]\nsettle_s = 0\n[console]\nlisten = "{HOST}:0"\n'
    return agents_config(workdir, pki, p.heartbeat, p.unreachable_after, p.lost_after, more=more)


@dataclass
class Params:
    nodes: int
    models: int
    replicas: int
    requests: int
    loads: int
    changes: int
    unreachable: int
    window: float
    change_every: float
    consoles: int
    consoles_in: str
    heartbeat: float
    unreachable_after: float
    lost_after: float
    workers: int
    keep_logs: bool
    gc_log: bool

    @property
    def total(self) -> int:
        return self.models * self.replicas


@dataclass
class Run:
    """Everything one run started (stopped by ``close``) and measured."""

    p: Params
    workdir: Path
    server: Proc | None = None
    fleet: Fleet | None = None
    admin: Admin | None = None
    console: str = ""
    admin_token: str = ""
    viewer_token: str = ""
    browsers: list[Chrome] = field(default_factory=list)
    res: dict[str, Any] = field(default_factory=dict)
    page_errors: list[str] = field(default_factory=list)

    def browser(self, name: str, *, tabs: bool = False) -> Chrome:
        b = Chrome(self.workdir, name, tabs=tabs)
        self.browsers.append(b)
        return b

    def close_browser(self, b: Chrome) -> None:
        self.page_errors += [f"{b.name}: {e}" for e in b.errors()]
        b.quit()
        if b in self.browsers:
            self.browsers.remove(b)

    def close(self) -> None:
        """Every browser, the agent workers, the server: each stopped whatever the
        others did."""
        stops: list[Any] = [lambda b=b: self.close_browser(b) for b in list(self.browsers)]
        if self.fleet is not None:
            stops.append(self.fleet.stop)
        if self.admin is not None:
            stops.append(self.admin.close)
        if self.server is not None:
            stops.append(self.server.stop)
        for stop in stops:
            try:
                stop()
            except Exception as exc:  # the next one is stopped all the same
                print(f"while stopping: {type(exc).__name__}: {exc}", file=sys.stderr)

    def intent(self, node: str, intent: str) -> None:
        assert self.admin is not None
        r = self.admin.client.post(f"/v1/nodes/{node}", json={"intent": intent})
        if r.status_code != 200:
            raise Failed(f"{intent} {node}: {r.status_code} {r.text[:200]}")


def start(run: Run) -> None:
    p, workdir = run.p, run.workdir
    pki = ensure_pki(p.nodes)
    cfg = write_config(workdir, pki, p)
    env = gc_env(workdir) if p.gc_log else None
    server = Proc("server", llmgw("server", "--config", str(cfg)), workdir, env=env,
                  session=True, preexec=_pdeathsig, grace_s=10)  # fmt: skip
    run.server = server.start()
    port = int(server.wait_log(r"agent stream listening on 127\.0\.0\.1:(\d+)", timeout=30)[1])
    run.console = server.wait_log(r"web console on (http://[^/\s,]+)/", timeout=30)[1]
    admin_url = server.wait_log(r"admin API listening on (http://\S+)", timeout=30)[1]
    state = workdir / "state"
    run.admin_token = (state / "admin-token").read_text().strip()
    run.viewer_token = (state / "console-viewer-token").read_text().strip()
    run.admin = Admin(admin_url, run.admin_token)
    print(f"  server pid {server.pid}: console {run.console}, admin {admin_url}")

    nworkers = max(1, min(p.workers, p.nodes))
    procs = [WorkerProc(i, workdir) for i in range(nworkers)]
    run.fleet = Fleet(procs)
    weights = weights_of(p.nodes, p.models)
    for w in procs:
        indices = list(range(w.idx, p.nodes, nworkers))
        w.send(
            {
                "port": port,
                "total": p.nodes,
                "ping": True,
                "pki": str(pki),
                "indices": indices,
                "shards": True,
                "ready_after_s": 0.05,
                "weights": {node_name(i): weights[node_name(i)] for i in indices},
                "weights_dirs": [WEIGHTS_DIR],
            }
        )
    run.fleet.gather("ready", timeout=60 + p.nodes * 0.05)
    t0 = time.time()
    run.fleet.send_all({"cmd": "go", "t0": t0 + 0.2, "spread": 2.0})
    run.fleet.gather("registered", timeout=60 + p.nodes * 0.05)
    print(f"  {p.nodes} agents registered in {time.time() - t0:.1f} s; placing {p.total} replicas")
    deadline = time.monotonic() + 120 + p.total * 0.3
    ready = 0
    last_said = time.monotonic()
    while True:
        server.check_running()
        r = run.admin.client.get("/v1/replicas", timeout=30)
        r.raise_for_status()
        replicas = r.json()["replicas"]
        ready = sum(x["state"] == "Ready" for x in replicas)
        if ready >= p.total:
            break
        if time.monotonic() > deadline:
            raise Failed(f"only {ready} of {p.total} replicas Ready after {time.time() - t0:.0f} s")
        if time.monotonic() - last_said > 10:
            print(f"    {ready} of {p.total} Ready ...")
            last_said = time.monotonic()
        time.sleep(1.0)
    run.res["placed_s"] = time.time() - t0
    nodes = run.admin.nodes()
    if sum(n["state"] == "Ready" for n in nodes.values()) != p.nodes:
        raise Failed(
            f"not every node is Ready: {[n for n, v in nodes.items() if v['state'] != 'Ready'][:5]}"
        )
    per_node = sorted(v.get("shards", 0) for v in nodes.values())
    print(
        f"  {ready} replicas Ready {run.res['placed_s']:.1f} s after the first connect "
        f"(shards per node {per_node[0]} to {per_node[-1]})"
    )


# =========================================================================== the measures


def api_latency(run: Run) -> None:
    """Each endpoint ``requests`` times in a row, one keep-alive client, the body read."""
    p = run.p
    assert run.server is not None
    print(f"  the console API: {len(ENDPOINTS)} endpoints x {p.requests} requests ...")
    out: dict[str, dict[str, Any]] = {}
    assert run.admin is not None
    m0 = run.admin.metrics()
    with httpx.Client(base_url=run.console, timeout=30) as client:
        r = client.post("/api/login", json={"token": run.viewer_token})
        if r.status_code != 200:
            raise Failed(f"POST /api/login with the viewer token: {r.status_code} {r.text[:200]}")
        for name in ENDPOINTS:
            times: list[float] = []
            size = 0
            for i in range(3):  # warm-up (the first placement call of a model, caches)
                client.get(path_of(name, i, p.models)).raise_for_status()
            c0 = cpu_seconds(run.server.pid)
            w0 = time.time()
            for i in range(p.requests):
                path = path_of(name, i, p.models)
                t = time.perf_counter()
                r = client.get(path)
                body = r.content
                times.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise Failed(f"GET {path}: {r.status_code} {body[:200]!r}")
                size = max(size, len(body))
            cpu = (cpu_seconds(run.server.pid) - c0) / p.requests
            out[name] = {
                "p50": percentile(times, 0.5),
                "p99": percentile(times, 0.99),
                "max": max(times),
                "bytes": size,
                "cpu": cpu,
                "n": len(times),
                "slow": sum(t > GOAL_API_P99_S for t in times),
                "gc": gc_pauses(run.workdir, w0, time.time()),
            }
            print(
                f"    /api/{name}: p50 {ms(out[name]['p50'])}, p99 {ms(out[name]['p99'])}, "
                f"{size / 1024:.0f} KiB, server CPU {cpu * 1000:.1f} ms a request"
            )
    run.res["api"] = out
    h0 = dict(histogram(m0, "llmgw_reconcile_pass_seconds"))
    delta = [
        (le, c - h0.get(le, 0.0))
        for le, c in histogram(run.admin.metrics(), "llmgw_reconcile_pass_seconds")
    ]
    run.res["passes"] = (
        delta[-1][1] if delta else 0,
        bucket_quantile(delta, 0.5),
        bucket_quantile(delta, 0.99),
    )


def path_of(name: str, i: int, models: int) -> str:
    if name == "placement":
        return f"/api/models/{model_name(i % models)}/placement"
    return f"/api/{name}"


def first_loads(run: Run) -> Chrome:
    """Cold loads (the cache emptied; the first in a fresh browser), then warm ones.
    Returns the browser, left on the fleet page."""
    p = run.p
    print(f"  first page load: {p.loads} cold, {p.loads} warm ...")
    b = run.browser("loads")
    fleet_watch(b, p.nodes, p.models)
    b.sign_in_by_form(run.console, run.admin_token)
    b.wait_js("window.__bench.painted !== null", 30, "the fleet after signing in")
    signed_in = b.js("return window.__bench.painted - window.__bench.clicked")
    cold, warm = [], []
    for _ in range(p.loads):
        b.cdp("Network.clearBrowserCache")
        cold.append(reload_fleet(b))
    for _ in range(p.loads):
        warm.append(reload_fleet(b))
    run.res["cold"], run.res["warm"] = cold, warm
    run.res["signin"] = signed_in / 1000
    print(f"    signing in (the form's button) to the fleet painted: {signed_in:.0f} ms")
    for label, got in (("cold", cold), ("warm", warm)):
        print(
            f"    {label}: rendered "
            + ", ".join(f"{x['rendered']:.0f}" for x in got)
            + " ms; painted "
            + ", ".join(f"{x['painted']:.0f}" for x in got)
            + " ms"
        )
    api = cold[0]["api"]
    print("    first load's API calls: " + ", ".join(f"{k} {v:.0f} ms" for k, v in api.items()))
    return b


def change_latency(run: Run, b: Chrome) -> None:
    """Cordon then uncordon ``changes`` nodes, one at a time, each timed to the screen."""
    p = run.p
    print(f"  a change on screen: {p.changes} cordons and uncordons through the admin API ...")
    cordon: list[tuple[float, float]] = []
    uncordon: list[tuple[float, float]] = []
    for i in range(p.changes):
        node = node_name((i * 7) % p.nodes)
        for intent, word, has, into in (
            ("cordon", "cordoned", True, cordon),
            ("uncordon", "cordoned", False, uncordon),
        ):
            b.js(WATCH_CELLS, "intent", [[node, word, has]])
            time.sleep(0.2 + 0.3 * (i % 4) / 4)  # not in step with the feed's 100 ms gather
            before = time.time()
            run.intent(node, intent)
            seen = b.wait_js(
                "window.__seen[arguments[0]] && window.__seen[arguments[0]].painted",
                10,
                f"{node}'s intent reading {'' if has else 'no longer '}{word!r}",
                node,
            )
            got = b.js("return window.__seen[arguments[0]]", node)
            into.append((got["dom"] / 1000 - before, seen / 1000 - before))
    run.res["cordon"], run.res["uncordon"] = cordon, uncordon
    print(
        "    cordon: "
        + ", ".join(f"{x[1] * 1000:.0f}" for x in cordon)
        + " ms; uncordon: "
        + ", ".join(f"{x[1] * 1000:.0f}" for x in uncordon)
        + " ms (painted)"
    )


def logged_at(stamp: str) -> float:
    """The wall clock of a server log line's ``2026-12-05 19:46:30,239``."""
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:23]) / 1000


def unreachable_latency(run: Run, b: Chrome) -> None:
    """Silence agents a few seconds apart (their connections kept open); each one's
    lateness from the server's log line to the page's ``td.state``."""
    p = run.p
    assert run.fleet is not None and run.server is not None
    nworkers = len(run.fleet.workers)
    victims = [node_name(p.nodes - 1 - 3 * k) for k in range(p.unreachable)]
    print(
        f"  Unreachable on screen: silencing {', '.join(victims)}, "
        f"{p.unreachable_after:g} s to wait each ..."
    )
    b.js(WATCH_CELLS, "state", [[v, "Unreachable", True] for v in victims])
    for v in victims:
        idx = int(v.removeprefix("bench-")) % nworkers
        run.fleet.workers[idx].send({"cmd": "silence", "node": v})
        run.fleet.gather("silenced", timeout=10, count=1)
        time.sleep(1.3)
    out = []
    for v in victims:
        m = run.server.wait_log(
            rf"(?m)^(\S+ \S+) WARNING \S+: node {re.escape(v)} is Unreachable",
            timeout=p.unreachable_after * 3 + 10,
        )
        said = logged_at(m[1])
        painted = b.wait_js(
            "window.__seen[arguments[0]] && window.__seen[arguments[0]].painted",
            10,
            f"{v}'s state reading Unreachable",
            v,
        )
        dom = b.js("return window.__seen[arguments[0]].dom", v)
        out.append((dom / 1000 - said, painted / 1000 - said))
    run.res["unreachable"] = out
    print("    " + ", ".join(f"{x[1] * 1000:.0f}" for x in out) + " ms (painted)")


def cpu_window(run: Run, label: str, browsers: list[Chrome]) -> dict[str, Any]:
    """The server's CPU over the window, a cordon or uncordon every ``change_every`` s
    (alternating, on a few nodes; none left cordoned)."""
    p = run.p
    assert run.server is not None
    pid = run.server.pid
    lines0 = run.server.log().count("\n")
    changes = 0
    w0 = time.monotonic()
    c0 = cpu_seconds(pid)
    b0 = sum(x.cpu() for x in browsers)
    per_s: list[float] = []
    last_t, last_c = w0, c0
    next_change = w0
    cordoned: str | None = None
    while (now := time.monotonic()) - w0 < p.window:
        if now >= next_change:
            if cordoned is None:
                cordoned = node_name((changes * 11 + 5) % p.nodes)
                run.intent(cordoned, "cordon")
            else:
                run.intent(cordoned, "uncordon")
                cordoned = None
            changes += 1
            next_change += p.change_every
        time.sleep(max(0.0, min(0.5, next_change - time.monotonic(), p.window - (now - w0))))
        t, c = time.monotonic(), cpu_seconds(pid)
        if t - last_t >= 1.0:
            per_s.append((c - last_c) / (t - last_t))
            last_t, last_c = t, c
    elapsed = time.monotonic() - w0
    cpu = cpu_seconds(pid) - c0
    bcpu = sum(x.cpu() for x in browsers) - b0
    if cordoned is not None:
        run.intent(cordoned, "uncordon")
    run.server.check_running()
    lines = run.server.log().count("\n") - lines0
    out = {
        "pct": 100 * cpu / elapsed,
        "max1s": 100 * max(per_s) if per_s else None,
        "browsers_pct": 100 * bcpu / elapsed,
        "changes": changes,
        "window": elapsed,
        "log_lines": lines,
    }
    print(
        f"    {label}: server {out['pct']:.1f}% of a core (busiest second "
        f"{out['max1s'] or 0:.1f}%), {changes} changes, {lines} log lines"
        + (f"; browsers {out['browsers_pct']:.0f}%" if browsers else "")
    )
    return out


# ``--gc-log``: the server's cyclic garbage collections, each full one (and any other
# over 5 ms) a line "wall generation seconds collected", from a sitecustomize on its
# PYTHONPATH (the server's code untouched; a callback per collection costs nothing)
GC_HOOK = """
import gc, os, time
if os.environ.get("LLMGW_BENCH_GC_LOG"):
    _out = open(os.environ["LLMGW_BENCH_GC_LOG"], "a", buffering=1)
    _began = [0.0]
    def _bench_gc(phase, info):
        if phase == "start":
            _began[0] = time.perf_counter()
            return
        took = time.perf_counter() - _began[0]
        if info["generation"] == 2 or took > 0.005:
            _out.write(f"{time.time():.4f} {info['generation']} {took:.5f} {info['collected']}\\n")
    gc.callbacks.append(_bench_gc)
"""


def gc_env(workdir: Path) -> dict[str, str]:
    hook = workdir / "gc-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(GC_HOOK)
    path = os.pathsep.join(x for x in (str(hook), os.environ.get("PYTHONPATH", "")) if x)
    return {"PYTHONPATH": path, "LLMGW_BENCH_GC_LOG": str(workdir / "gc.log")}


def gc_pauses(workdir: Path, since: float, until: float) -> tuple[int, float, float] | None:
    """The server's full collections between two wall clocks: how many, their total and
    longest seconds; None without ``--gc-log``."""
    path = workdir / "gc.log"
    if not path.exists():
        return None
    full = []
    for line in path.read_text().splitlines():
        wall, gen, took, _ = line.split()
        if gen == "2" and since <= float(wall) <= until:
            full.append(float(took))
    return len(full), sum(full), max(full, default=0.0)


LIVE = (
    "window.__bench && window.__bench.rendered !== null && document.querySelector('#live')"
    " && document.querySelector('#live').textContent === 'live'"
)


def open_consoles(run: Run) -> tuple[list[Chrome], list[tuple[Chrome, str]], dict[int, str]]:
    """``consoles`` signed-in fleet pages, live: each in a Chromium of its own, or as
    tabs of one. Returns the browsers, the (browser, window handle) of each page, and
    what kept any page from being rendered and live within 30 s."""
    p = run.p
    pages: list[tuple[Chrome, str]] = []
    browsers: list[Chrome] = []
    if p.consoles_in == "browsers":
        for i in range(p.consoles):
            b = run.browser(f"console-{i}")
            browsers.append(b)
            fleet_watch(b, p.nodes, p.models)
            b.sign_in_by_form(run.console, run.viewer_token)
            pages.append((b, b.driver.current_window_handle))
    else:
        b = run.browser("consoles", tabs=True)
        browsers.append(b)
        for i in range(p.consoles):
            if i:
                b.driver.switch_to.new_window("tab")
            fleet_watch(b, p.nodes, p.models)
            if i == 0:  # the cookie and the page's signed-in hint serve every tab
                b.sign_in_by_form(run.console, run.viewer_token)
                b.wait_js(LIVE, 30, "the first tab rendered and live")
            else:
                b.driver.get(run.console + "/#/fleet")  # returns at once (strategy "none")
            pages.append((b, b.driver.current_window_handle))
    stuck: dict[int, str] = {}
    deadline = time.monotonic() + 30
    for i, (b, handle) in enumerate(pages):
        try:
            b.driver.switch_to.window(handle)
            b.wait_js(LIVE, max(1.0, deadline - time.monotonic()), "its fleet rendered and live")
        except (Failed, WebDriverException) as exc:
            stuck[i] = str(exc).strip().splitlines()[0][:300]
    return browsers, pages, stuck


def page_counts(pages: list[tuple[Chrome, str]], stuck: dict[int, str]) -> list[dict[str, Any]]:
    """Each page's fetches so far, its live indicator and its visibility (a page that
    never came up is not asked: each call to it would wait out the script timeout)."""
    out: list[dict[str, Any]] = []
    for i, (b, handle) in enumerate(pages):
        if i in stuck:
            out.append({"calls": 0, "live": "never came up", "visible": "?"})
            continue
        try:
            b.driver.switch_to.window(handle)
            got = b.js(
                "const live = document.querySelector('#live');"
                "return {calls: window.__bench ? window.__bench.calls : 0,"
                " live: live ? live.textContent : 'no page', visible: document.visibilityState}"
            )
        except WebDriverException as exc:
            got = {"calls": 0, "live": f"unreadable: {exc.msg}", "visible": "?"}
        out.append(got)
    return out


def consoles_cpu(run: Run) -> Chrome:
    """The window with no console open, then with ``consoles`` open. Returns a browser
    left on a fleet page (the first console), for the Unreachable case."""
    p = run.p
    print(f"  the server's CPU, {p.window:g} s windows, a change every {p.change_every:g} s ...")
    run.res["cpu_none"] = cpu_window(run, "no console", [])
    print(f"    opening {p.consoles} consoles ({p.consoles_in}) ...")
    browsers, pages, stuck = open_consoles(run)
    for i, why in stuck.items():
        print(f"    console {i} did not come up: {why}")
    time.sleep(2.0)
    before = page_counts(pages, stuck)
    run.res["cpu_consoles"] = cpu_window(run, f"{p.consoles} consoles", browsers)
    time.sleep(1.0)  # the last change's fetches
    after = page_counts(pages, stuck)
    calls = [a["calls"] - b["calls"] for a, b in zip(after, before, strict=True)]
    run.res["console_pages"] = {
        "calls": calls,
        "live": sum(a["live"] == "live" for a in after),
        "visible": sorted({a["visible"] for a in after}),
        # each change (a cordon or uncordon) is one fetch of /api/nodes and /api/models
        "behind": sum(c < 2 * run.res["cpu_consoles"]["changes"] for c in calls),
        "stuck": len(stuck),
    }
    keep, handle = pages[0]  # the first console, which came up (or the run failed)
    for b in browsers:
        if b is not keep:
            run.close_browser(b)
    for other, h in pages[1:]:
        if other is keep:  # tabs: the others' live feeds hold connections: close them
            keep.driver.switch_to.window(h)
            keep.driver.close()
    keep.driver.switch_to.window(handle)
    return keep


# =========================================================================== report


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def p50_max(xs: list[float]) -> str:
    mid = percentile(xs, 0.5)
    if mid is None:
        return "-"
    return f"{mid * 1000:.0f} / {max(xs) * 1000:.0f} ms (n={len(xs)})"


def report(run: Run) -> bool:
    p, res = run.p, run.res
    rows: list[tuple[str, str, str, bool | None]] = []

    def row(measure: str, goal: str, measured: str, met: bool | None) -> None:
        rows.append((measure, goal, measured, met))

    for label in ("cold", "warm"):
        got = res.get(label)
        if got:
            painted = [x["painted"] / 1000 for x in got]
            row(
                f"first page load, {label} (p50 / max)",
                "<= 1 s",
                p50_max(painted),
                max(painted) <= GOAL_LOAD_S,
            )
    if "signin" in res:
        row(
            "  sign-in button -> fleet painted",
            "(reported)",
            f"{res['signin'] * 1000:.0f} ms",
            None,
        )
    for name, v in res.get("api", {}).items():
        row(
            f"GET {path_of(name, 0, p.models).replace(model_name(0), 'M')} p50 / p99",
            "p99 <= 50 ms",
            f"{ms(v['p50'])} / {ms(v['p99'])} (n={v['n']})",
            v["p99"] <= GOAL_API_P99_S,
        )
    for key, label in (("cordon", "cordon"), ("uncordon", "uncordon")):
        got = res.get(key)
        if got:
            painted = [x[1] for x in got]
            row(f"{label} -> on screen (p50 / max)", "<= 1 s", p50_max(painted),
                max(painted) <= GOAL_CHANGE_S)  # fmt: skip
    got = res.get("unreachable")
    if got:
        painted = [x[1] for x in got]
        row("Unreachable (server's log) -> on screen", "<= 1 s", p50_max(painted),
            max(painted) <= GOAL_CHANGE_S)  # fmt: skip
    none, cons = res.get("cpu_none"), res.get("cpu_consoles")
    if none:
        row("server CPU, no console", "(reported)", f"{none['pct']:.1f}% of one core", None)
    if cons:
        pages = res["console_pages"]
        row(
            f"server CPU, {p.consoles} consoles ({p.consoles_in})",
            "(no figure set)",
            f"{cons['pct']:.1f}% of one core (+{cons['pct'] - none['pct']:.1f})" if none else "-",
            None,
        )
        row(
            "  consoles live and showing every change",
            f"{p.consoles} of {p.consoles}",
            f"{pages['live']} live, {p.consoles - pages['behind']} kept up",
            pages["live"] == p.consoles and pages["behind"] == 0,
        )

    print()
    print(
        f"{p.nodes} nodes x 8 GPUs, {p.models} models x {p.replicas} replicas = {p.total} "
        f"Ready; heartbeat {p.heartbeat:g} s; {os.cpu_count()} CPUs"
    )
    if not rows:
        print("nothing was measured")
        return False
    w = [max(len(str(r[i])) for r in rows) for i in range(3)]
    head = ("measure", "goal", "measured")
    print(f"{head[0]:<{w[0]}}  {head[1]:<{w[1]}}  {head[2]}")
    print("-" * (sum(w) + 4 + 8))
    for measure, goal, measured, met in rows:
        mark = "" if met is None else ("  met" if met else "  NOT MET")
        print(f"{measure:<{w[0]}}  {goal:<{w[1]}}  {measured:<{w[2]}}{mark}".rstrip())
    print()
    for label in ("cold", "warm"):
        got = res.get(label)
        if got:
            rendered = [x["rendered"] / 1000 for x in got]
            print(
                f"{label} loads, DOM rendered (before the frame that paints it): "
                f"{p50_max(rendered)}; DOMContentLoaded p50 "
                f"{percentile([x['dcl'] or 0 for x in got], 0.5):.0f} ms"
            )
    for key in ("cordon", "uncordon", "unreachable"):
        got = res.get(key)
        if got:
            print(f"{key}: the DOM changed after {p50_max([x[0] for x in got])} (p50 / max)")
    api = res.get("api", {})
    if api:
        print("the console API, each endpoint: its body, the server's CPU per request, the")
        print("slowest request, how many took over 50 ms, and the server's full GCs meanwhile:")
        for n, v in api.items():
            gc = v["gc"]
            pauses = (
                "(--gc-log to see them)"
                if gc is None
                else f"{gc[0]} full GCs, {gc[1] * 1000:.0f} ms in all, longest {gc[2] * 1000:.0f} ms"
            )
            print(
                f"  {n:<9} {v['bytes'] / 1024:4.0f} KiB, CPU {v['cpu'] * 1000:4.1f} ms, "
                f"max {ms(v['max'])}, {v['slow']} over 50 ms; {pauses}"
            )
        n_passes, q50, q99 = res["passes"]
        if n_passes:
            print(
                f"  the control plane's reconcile passes meanwhile (the same event loop): "
                f"{n_passes:.0f}, p50 {q50[0] * 1000:.0f} ms, p99 {q99[0] * 1000:.0f} ms "
                f"(histogram, bucket resolution)"
            )
    if none and cons:
        pages = res["console_pages"]
        print(
            f"CPU windows {none['window']:.0f} s, {none['changes']} / {cons['changes']} changes; "
            f"busiest second {none['max1s'] or 0:.1f}% / {cons['max1s'] or 0:.1f}%; "
            f"server log lines {none['log_lines']} / {cons['log_lines']}; "
            f"the browsers' own CPU {cons['browsers_pct']:.0f}% (they share the cores)"
        )
        print(
            f"console pages: fetches in the window {pages['calls']}, "
            f"visibility {'/'.join(pages['visible'])}"
        )
    if "placed_s" in res:
        print(
            f"placement of all {p.total} replicas: {res['placed_s']:.1f} s after the first connect"
        )
    problems = log_problems(run.server.log() if run.server is not None else "")
    if problems:
        print("server log, WARNING and worse (numbers masked):")
        for count, line in problems:
            print(f"  x{count}: {line}")
    else:
        print("server log: no WARNING or worse, beyond the silenced nodes")
    if run.page_errors:
        print(f"the pages' console errors ({len(run.page_errors)}):")
        for e in run.page_errors[:10]:
            print(f"  {e[:300]}")
    else:
        print("the pages' console: no errors")
    return all(met is not False for *_, met in rows) and bool(rows)


def log_problems(text: str) -> list[tuple[int, str]]:
    groups: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (.*)$", line)
        if not m:
            if line.startswith("Traceback"):
                groups["Traceback"] = groups.get("Traceback", 0) + 1
            continue
        if re.search(r"node bench-\d+ is Unreachable \(was Ready\)", m[2]):
            continue  # the silenced agents
        if "no node has registered" in m[2]:
            continue  # the first passes, before the agents connect (settle_s = 0)
        key = re.sub(r"\d+(\.\d+)?", "#", f"{m[1]} {m[2]}")[:160]
        groups[key] = groups.get(key, 0) + 1
    return sorted(((c, k) for k, c in groups.items()), reverse=True)[:10]


# =========================================================================== main


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="50 nodes, 200 replicas, fewer samples, 10 s windows (about 80 s)",
    )
    ap.add_argument("--nodes", type=int, help="simulated nodes, 8 GPUs each (200)")
    ap.add_argument("--models", type=int, help="models in the catalog (50)")
    ap.add_argument("--replicas", type=int, help="replicas per model (20)")
    ap.add_argument("--requests", type=int, help="requests per API endpoint (300)")
    ap.add_argument("--loads", type=int, help="cold loads, and as many warm (5)")
    ap.add_argument("--changes", type=int, help="cordons (and uncordons) timed (10)")
    ap.add_argument("--unreachable", type=int, help="agents silenced, timed (3)")
    ap.add_argument("--window", type=float, help="each CPU window, s (30)")
    ap.add_argument("--change-every", type=float, default=3.0, help="in the windows, s (3)")
    ap.add_argument("--consoles", type=int, default=10, help="consoles open in the window (10)")
    ap.add_argument(
        "--consoles-in",
        choices=("browsers", "tabs"),
        default="browsers",
        help="a Chromium each (default), or tabs of one (six tabs starve: see above)",
    )
    ap.add_argument("--heartbeat", type=float, help="agents' heartbeat interval, s (5)")
    ap.add_argument("--unreachable-after", type=float, help="s of silence (15)")
    ap.add_argument("--workers", type=int, default=2, help="agent processes (2)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the run's folder and logs")
    ap.add_argument(
        "--gc-log",
        action="store_true",
        help="log the server's full garbage collections (a sitecustomize on its PYTHONPATH) "
        "and show those during each endpoint's requests",
    )
    args = ap.parse_args()
    q = args.quick

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else (quick if q else full)

    hb = pick(args.heartbeat, 5.0, 1.0)
    unreachable_after = pick(args.unreachable_after, 15.0, 3.0)
    p = Params(
        nodes=pick(args.nodes, 200, 50),
        models=pick(args.models, 50, 10),
        replicas=pick(args.replicas, 20, 20),
        requests=pick(args.requests, 300, 60),
        loads=pick(args.loads, 5, 2),
        changes=pick(args.changes, 10, 4),
        unreachable=pick(args.unreachable, 3, 1),
        window=pick(args.window, 30.0, 10.0),
        change_every=args.change_every,
        consoles=args.consoles,
        consoles_in=args.consoles_in,
        heartbeat=hb,
        unreachable_after=unreachable_after,
        lost_after=max(600.0, unreachable_after * 4),
        workers=args.workers,
        keep_logs=args.keep_logs,
        gc_log=args.gc_log,
    )
    if not hb < unreachable_after:
        ap.error("need --heartbeat < --unreachable-after")
    if p.total > p.nodes * 8:
        ap.error(f"{p.total} 1-GPU replicas do not fit on {p.nodes} nodes of 8 GPUs")
    if min(p.nodes, p.models, p.requests, p.loads, p.changes, p.consoles) < 1:
        ap.error("sizes and counts must be at least 1")
    if not 0 <= 3 * p.unreachable <= p.nodes:
        ap.error("--unreachable: 0 to a third of the nodes")
    missing = browser_missing()
    if missing:
        print(f"bench_console needs {missing} (tools/setup installs them)", file=sys.stderr)
        return 1
    raise_nofile()
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-console-"))
    run = Run(p, workdir)
    started = time.monotonic()
    print(
        f"{p.nodes} simulated nodes, {p.total} replicas; {p.consoles} consoles in "
        f"{p.consoles_in}; folder {workdir}"
    )
    status = 1
    try:
        start(run)
        api_latency(run)
        b = first_loads(run)
        change_latency(run, b)
        run.close_browser(b)  # no console open for the first CPU window
        b = consoles_cpu(run)
        if p.unreachable:
            unreachable_latency(run, b)
        for b in list(run.browsers):
            run.close_browser(b)
        status = 0 if report(run) else 1
    except (Failed, WebDriverException) as exc:
        print(f"\nbenchmark failed: {exc}", file=sys.stderr)
        if run.res:
            report(run)
        status = 1
    except KeyboardInterrupt:
        print("\ninterrupted; every process started here is being stopped", file=sys.stderr)
        status = 130
    finally:
        run.close()
        if p.keep_logs or status not in (0, 130):
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"took {time.monotonic() - started:.0f} s")
    return status


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())
