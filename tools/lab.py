"""``tools/lab``: the lab's command line (see README "The lab"; the lab itself is
``tools.support.lab``, the same code the fault benchmark and ``tests/lab`` use).

    tools/lab up 2 [--detach] [--gpus] [--routers N] [--pyz FILE] [--small-disk NODE]
    tools/lab partition|heal|netem|kill|restart|fill-disk|status ...
    tools/lab down

Root only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from tools.support import lab as the_lab
from tools.support.lab import WIDE_MODEL, Lab, LabError, default_dir


def _banner(lab: Lab) -> str:
    base, key, d = lab.base_url, lab.key, lab.dir
    nodes = ", ".join(f"{n} {e['ip']}" for n, e in lab.state["nodes"].items())
    return (
        f"lab {lab.name} is up: control plane {lab.state['cp']['ip']}, nodes {nodes}"
        f"\n  base URL: {', '.join(lab.base_urls)}\n  API key:  {key}"
        f"\n  curl {base}/chat/completions -H 'authorization: Bearer {key}' "
        """-H 'content-type: application/json' """
        """-d '{"model":"tiny","messages":[{"role":"user","content":"hi"}]}'"""
        + (f"\n  model {WIDE_MODEL!r}: vLLM over Ray (stand-ins) on two nodes" if lab.gpus else "")
        + f"\n  .venv/bin/llmgw ctl nodes --config {d / 'server.toml'}"
        f"\n  tools/lab partition n1 --dir {d}   (heal, netem, kill, restart, fill-disk)"
        f"\n  logs in {d}/*.log; tools/lab down --dir {d} removes everything"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/lab", description=the_lab.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--name", default="lab0", help="the lab's name, 1-5 of a-z0-9 (lab0)")
        p.add_argument("--dir", type=Path, help="its state (default /tmp/llmgw-lab-NAME)")
        return p

    up = verb("up", "build N nodes, start the fleet, print the base URL and a key")
    up.add_argument("n", type=int, metavar="N")
    up.add_argument("--detach", action="store_true", help="return once it is up")
    up.add_argument("--small-disk", action="append", default=[], metavar="NODE")
    up.add_argument("--lost-after", type=float, default=30.0, metavar="S")
    up.add_argument("--gpus", action="store_true",
                    help="a fake H200 per node, vLLM and Ray stand-ins, and a model over 2 nodes")  # fmt: skip
    up.add_argument("--routers", type=int, default=1, metavar="N",
                    help="standalone routers on the host, on ports 8000, 8001, ... (1)")  # fmt: skip
    up.add_argument("--pyz", type=Path, metavar="FILE",
                    help="run every daemon from this single file (tools/build) instead")  # fmt: skip
    verb("down", "stop everything and remove every namespace, link and mount")
    p = verb("partition", "cut a node off: link down, or --drop every packet")
    p.add_argument("node")
    p.add_argument("--drop", action="store_true")
    verb("heal", "undo partition and netem").add_argument("node")
    p = verb("netem", "latency towards a node, loss each way")
    p.add_argument("node")
    p.add_argument("--delay", default="")
    p.add_argument("--loss", default="")
    p = verb("kill", "signal cp, router, NODE's agent, or `engine NODE`")
    p.add_argument("who", nargs="+", metavar="cp|router|NODE|engine NODE")
    p.add_argument("--signal", default="KILL", help="9, KILL, TERM, STOP, CONT (KILL)")
    p.add_argument("--shard", default="", help="with engine: only shards whose id starts so")
    p = verb("restart", "stop and start cp, a router or NODE's agent")
    p.add_argument("who")
    p.add_argument("--pyz", type=Path, metavar="FILE",
                   help="from now on run it from this single file: an upgrade")  # fmt: skip
    p = verb("fill-disk", "fill a --small-disk node's state dir (--free: empty it)")
    p.add_argument("node")
    p.add_argument("--free", action="store_true")
    verb("status", "the nodes as the control plane sees them")
    args = parser.parse_args(argv)
    d = args.dir or default_dir(args.name)
    try:
        if args.verb == "up":
            return _up(args, d)
        lab = Lab.load(d)
        if args.verb == "down":
            lab.down()
            print(f"lab {lab.name} is down: nothing left of it")
        elif args.verb == "partition":
            lab.partition(args.node, drop=args.drop)
        elif args.verb == "heal":
            lab.heal(args.node)
        elif args.verb == "netem":
            lab.netem(args.node, delay=args.delay, loss=args.loss)
        elif args.verb == "kill":
            who = args.who
            engine = who[0] == "engine"
            if len(who) != (2 if engine else 1):
                raise LabError("kill: name one of cp, router, NODE, or `engine NODE`")
            pids = lab.kill(who[-1], args.signal, engine=engine, shard=args.shard)
            print(f"sent {args.signal} to {' '.join(map(str, pids))}")
        elif args.verb == "restart":
            program = [sys.executable, str(args.pyz.resolve())] if args.pyz else None
            print(f"{args.who} restarted: pid {lab.restart(args.who, program)}")
        elif args.verb == "fill-disk":
            lab.fill_disk(args.node, free=args.free)
        elif args.verb == "status":
            for n in lab.nodes():
                print(f"{n['node_id']:8} {n['state']:12} {n['address']}")
    except LabError as e:
        print(f"lab: {e}", file=sys.stderr)
        return 1
    return 0


def _up(args: argparse.Namespace, d: Path) -> int:
    program = [sys.executable, str(args.pyz.resolve())] if args.pyz else None
    lab = Lab(d, name=args.name, nodes=args.n, small_disk=tuple(args.small_disk),
              lost_after_s=args.lost_after, gpus=args.gpus, routers=args.routers,
              program=program)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # Ctrl-C while it builds: up() tears down what it made
        signal.signal(signal.SIGINT, signal.default_int_handler)
        lab.up()
    except KeyboardInterrupt:
        print("lab: interrupted; torn down", file=sys.stderr)
        return 130
    except LabError as e:
        print(f"lab: {e}", file=sys.stderr)
        return 1
    print(_banner(lab), flush=True)
    if args.detach:
        return 0
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("  Ctrl-C tears it down", flush=True)
    while not stop.wait(0.5):
        with contextlib.suppress(ChildProcessError):  # reap what a fault verb killed
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not (d / "lab.json").exists() or not Lab.load(d).state.get("procs"):
            return 0  # `tools/lab down` from another shell
    try:
        lab.state = Lab.load(d).state  # restarts from other shells changed the pids
        lab.down()
    except LabError as e:
        print(f"lab: {e}", file=sys.stderr)
        return 1
    print(f"lab {lab.name} is down: nothing left of it", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
