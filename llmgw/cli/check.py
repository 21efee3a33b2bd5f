"""``llmgw agent --check``: a preflight of a node, step by step, in words.

It reads the agent's config and certificates, then dials each control plane
address as the agent would: name lookup, TCP, TLS, and a registration marked
``check_only``, which the control plane proves (the certificate's common name
against the node id) and acks without touching its node table. Then it runs
discovery once and shows what it found; a node with no engine at all
(llama-server, vLLM) fails there, since nothing could be placed on it. Each
step prints one line, ``ok`` or ``FAILED`` with the reason and what to do (the
agent's own wording); the first failure ends the check with status 1 (a bad
config: 2, as the agent).

It never takes the state dir's lock nor the node's, reads no engine records, and starts and
stops nothing: an agent running on the node goes on undisturbed.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import trio
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

from llmgw.addr import join_hostport
from llmgw.agent import hostlock
from llmgw.agent.inventory import InventorySource
from llmgw.agent.lock import LOCK_FILE
from llmgw.agent.stream import certificate_problem, connect_problem, read_certificate_names
from llmgw.config import AgentConfig, ConfigError, load_config, parse_hostport
from llmgw.config.schema import resolve
from llmgw.protocol import SUBPROTOCOL, CloseCode, ProtocolError, Role, Session
from llmgw.protocol.messages import Inventory, Register, RegisterAck
from llmgw.serve.agent import node_id as configured_node_id
from llmgw.tls import TLSConfigError
from llmgw.tls.ca import CAError, describe_certificate
from llmgw.tls.contexts import NAME_MISMATCH, client_context
from llmgw.version import describe
from llmgw.wsio import close_quietly, close_ws, single_error

__all__ = ["check_agent"]

PROG = "llmgw agent --check"
EXIT_BLOCKED = 1
EXIT_CONFIG = 2
SERVER_CLOSE_WAIT_S = 2.0


class Blocked(Exception):
    """A step failed; the message says why and what to do."""

    def __init__(self, step: str, why: str) -> None:
        super().__init__(why)
        self.step = step


def check_agent(path: Path | None, overrides: list[str], say: Callable[[str], None] = print) -> int:
    """Run the preflight; the exit status (0 passed, 1 a blocker, 2 a bad config)."""
    try:
        config, base = load_config(AgentConfig, path, overrides)
    except ConfigError as exc:
        say(f"config: FAILED: {exc}")
        return EXIT_CONFIG
    if not config.control_plane:
        say("config: FAILED: control_plane is empty: list the HOST:PORT agents dial")
        return EXIT_CONFIG
    try:
        return trio.run(_check, config, base, path, say)
    except Blocked as exc:
        say(f"{exc.step}: FAILED: {exc}")
        return EXIT_BLOCKED
    except BaseExceptionGroup as group:
        blocked, _ = group.split(Blocked)
        if blocked is None:
            raise
        first = _first(blocked)
        say(f"{first.step}: FAILED: {first}")
        return EXIT_BLOCKED


def _first(group: BaseExceptionGroup[Blocked]) -> Blocked:
    inner = group.exceptions[0]
    return _first(inner) if isinstance(inner, BaseExceptionGroup) else inner


async def _check(
    config: AgentConfig, base: Path, path: Path | None, say: Callable[[str], None]
) -> int:
    node = configured_node_id(config)
    try:
        addresses = [
            parse_hostport(a, key=f"control_plane[{i}]") for i, a in enumerate(config.control_plane)
        ]
    except ConfigError as exc:
        raise Blocked("config", str(exc)) from None
    say(
        f"config: ok: {path or 'no file'}, node {node}, control plane {', '.join(config.control_plane)}"
    )

    ca = resolve(base, config.ca)
    cert = resolve(base, config.cert or f"pki/{node}.pem")
    key = resolve(base, config.key or f"pki/{node}-key.pem")
    try:
        ctx = client_context(ca, cert, key)
        probe = client_context(ca, cert, key, check_name=False)
        info = describe_certificate(cert)
    except (TLSConfigError, CAError) as exc:
        raise Blocked("certificates", str(exc)) from None
    if info["subject_cn"] != node:
        raise Blocked(
            "certificates",
            f"{cert} is for {info['subject_cn']!r} but this agent's node id is {node!r}:"
            f" the control plane would refuse it; issue one with llmgw ctl onboard {node}"
            f" (or set node_id = {info['subject_cn']!r})",
        )
    if not _issued_by(cert, ca):
        raise Blocked(
            "certificates",
            f"{cert} is not signed by the CA in {ca}: the control plane would refuse it;"
            f" issue one from the fleet's CA with llmgw ctl onboard {node}",
        )
    until = dt.datetime.fromisoformat(info["not_after"]).date()
    if info["expired"]:
        raise Blocked(
            "certificates",
            f"{cert} expired on {until}: issue a new one with llmgw ctl onboard {node}",
        )
    say(f"certificates: ok: {cert} (node {node}, valid until {until}), CA {ca}")

    running = _running_agent(resolve(base, config.state_dir))
    if running is not None:
        say(f"note: an agent runs on this state dir (pid {running}); the check leaves it alone")
    holder = hostlock.probe(node, hostlock.fleet_digest(ca))
    if holder is not None and (holder.pid is None or holder.pid != running):
        who = f"pid {holder.pid}" if holder.pid is not None else "pid unknown"
        say(
            f"note: an agent runs as node {node} on this host ({who}) with another state dir;"
            f" the check leaves it alone, but starting this one would be refused"
        )

    for host, port in addresses:
        await _dial(config, node, host, port, ctx, probe, str(ca), say)

    await _discovered(config, base, addresses[0], say)
    say(f"passed: node {node} can join the fleet")
    return 0


async def _dial(
    config: AgentConfig,
    node: str,
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    probe: ssl.SSLContext,
    ca_file: str,
    say: Callable[[str], None],
) -> None:
    where = join_hostport(host, port)
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Blocked("name lookup", connect_problem(host, where, exc)) from None
    found = sorted({str(i[4][0]) for i in infos})
    if found == [host.strip("[]")]:
        say(f"name lookup: ok: {host} is an address")
    else:
        say(f"name lookup: ok: {host} is {', '.join(found)}")

    try:
        with trio.fail_after(config.connect_timeout_s):
            tcp = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        raise Blocked(
            "TCP",
            f"no answer from {where} within {config.connect_timeout_s:g} s:"
            " a firewall, or a wrong address?",
        ) from None
    except OSError as exc:
        raise Blocked("TCP", connect_problem(host, where, exc)) from None
    say(f"TCP: ok: connected to {where}")

    tls = trio.SSLStream(tcp, ctx, server_hostname=host)
    try:
        try:
            with trio.fail_after(config.handshake_timeout_s):
                await tls.do_handshake()
        except trio.TooSlowError:
            raise Blocked(
                "TLS",
                f"{where} did not finish a TLS handshake within {config.handshake_timeout_s:g} s:"
                " is it llmgw server's agent stream port?",
            ) from None
        except trio.BrokenResourceError as exc:
            refused = exc.__cause__
            if isinstance(refused, ssl.SSLCertVerificationError):
                names = None
                if refused.verify_code in NAME_MISMATCH:
                    names = await read_certificate_names(
                        host, port, probe, config.handshake_timeout_s
                    )
                raise Blocked(
                    "TLS", certificate_problem(where, host, refused, names, ca_file)
                ) from None
            reason = refused.reason if isinstance(refused, ssl.SSLError) else None
            raise Blocked(
                "TLS",
                f"TLS with {where} failed: {reason or refused or exc}:"
                " is it llmgw server's agent stream port?",
            ) from None
        say(f"TLS: ok: {where}'s certificate is valid for {host} and signed by {ca_file}")
        await _register(config, node, host, where, tls, say)
    finally:
        await close_quietly(tls)


async def _register(
    config: AgentConfig,
    node: str,
    host: str,
    where: str,
    tls: trio.SSLStream[trio.SocketStream],
    say: Callable[[str], None],
) -> None:
    """The upgrade and a check-only registration; the control plane acks and closes."""
    refused_cert = (
        f"control plane {where} completed TLS but then closed or never answered: it most"
        " likely refused this agent's certificate (expired, from another CA, or none);"
        " the control plane's log names the reason"
    )
    timeout = config.handshake_timeout_s
    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                try:
                    with trio.fail_after(timeout):
                        ws = await wrap_client_stream(
                            nursery, tls, host, "/agent", subprotocols=[SUBPROTOCOL]
                        )
                except (trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError):
                    raise Blocked("identity", refused_cert) from None
                try:
                    ack = await _ask(ws, node, timeout)
                    say(
                        f"identity: ok: control plane {where} accepts node {node}"
                        f" (server {ack.server_version or 'version unknown'})"
                    )
                    await _await_close(ws, where, say)
                finally:
                    await close_ws(ws, CloseCode.NORMAL, "check done")
                nursery.cancel_scope.cancel()
    except ConnectionRejected as exc:
        body = (exc.body or b"").decode(errors="replace").strip()
        raise Blocked(
            "identity", f"control plane {where} refused the stream (HTTP {exc.status_code}): {body}"
        ) from None
    except HandshakeError as exc:
        raise Blocked("identity", f"WebSocket handshake with {where} failed: {exc}") from None
    except ConnectionClosed as exc:
        r = exc.reason
        code = r.code if r else None
        try:
            label = CloseCode(code).name if code is not None else "unknown"
        except ValueError:
            label = r.name if r else "unknown"
        text = (r.reason if r else "") or "no reason given"
        raise Blocked(
            "identity",
            f"control plane {where} refused this agent (node {node}): {code} {label}: {text}",
        ) from None
    except (trio.BrokenResourceError, trio.TooSlowError):
        raise Blocked("identity", refused_cert) from None
    except ProtocolError as exc:
        raise Blocked(
            "identity", f"protocol error with control plane {where}: {exc.reason}"
        ) from None


async def _ask(ws: WebSocketConnection, node: str, within: float) -> RegisterAck:
    session = Session(Role.AGENT)
    register = Register(
        node_id=node, inventory=Inventory(), agent_version=describe(), check_only=True
    )
    await ws.send_message(session.send(register))
    with trio.fail_after(within):
        ack = session.receive(await ws.get_message())
    assert isinstance(ack, RegisterAck)  # the session allows nothing else
    return ack


async def _await_close(ws: WebSocketConnection, where: str, say: Callable[[str], None]) -> None:
    """A control plane that knows ``check_only`` closes at once; an older one took the
    check for the node's registration, which the operator should hear of."""
    with trio.move_on_after(SERVER_CLOSE_WAIT_S):
        try:
            while True:
                await ws.get_message()
        except ConnectionClosed:
            return
    say(
        f"note: control plane {where} did not close after the check: it is older than"
        " check_only and took this as the node's registration (a running agent reconnects)"
    )


async def _discovered(
    config: AgentConfig, base: Path, control_plane: tuple[str, int], say: Callable[[str], None]
) -> None:
    logging.getLogger("llmgw.agent.discovery").setLevel(logging.CRITICAL)  # said below
    source = InventorySource(
        config.inventory,
        control_plane,
        discovery=config.discovery,
        weights=config.weights,
        base=base,
        llama_server=config.engines.llama_server,
    )
    await source.refresh()
    inv = source.inventory()
    found = source.discovered
    say(
        f"discovered: host {inv.hostname or '?'}, address {inv.address or '?'}, {inv.cpus or '?'} CPUs"
    )
    mem = inv.memory
    if mem.total_bytes is None:
        say("  memory: unknown")
    else:
        avail = "" if mem.available_bytes is None else f", {_gib(mem.available_bytes)} available"
        say(f"  memory: {_gib(mem.total_bytes)}{avail}")
    if not inv.gpus:
        say("  GPUs: none")
    for g in inv.gpus:
        size = f", {g.memory_total_mib / 1024:.0f} GiB" if g.memory_total_mib else ""
        health = "healthy" if g.healthy else "unhealthy: " + "; ".join(g.problems)
        say(f"  GPU {g.index}: {g.name or '?'}{size}, {health}")
    if inv.fabric:
        say(f"  fabric: {inv.fabric}")
    if inv.labels:
        say("  labels: " + ", ".join(f"{k}={v}" for k, v in sorted(inv.labels.items())))
    engines = [
        f"{e.name} {e.version}".strip() + (f" ({e.path})" if e.path else "") for e in inv.engines
    ]
    say(f"  engines: {', '.join(engines) or 'none'}")
    if inv.weights:
        say(f"  weights: {len(inv.weights)} copies")
        for w in inv.weights:
            size = f", {_gib(w.size_bytes)}" if w.size_bytes else ""
            say(f"    {w.model}: {w.path} ({w.format or '?'}{size}, {w.storage})")
    elif inv.weights_scanned:
        say("  weights: none in the weights dirs")
    else:
        where = resolve(base, config.weights.default_dir)
        say(f"  weights: not looked for (weights.dirs is empty and {where} does not exist)")
    for problem in found.problems if found else []:
        say(f"  problem: {problem}")
    if not inv.engines:
        raise Blocked("engines", no_engine(config))


def no_engine(config: AgentConfig) -> str:
    """Why no engine was found, and how a node gets one, in one line."""
    if config.engines.llama_server:
        where = f"[engines] llama_server = {config.engines.llama_server} cannot run (see above)"
    else:
        where = "no llama-server on PATH or in /opt/llama.cpp and the other usual places"
    return (
        f"no engine on this node ({where}; no vllm on PATH): nothing can be placed here;"
        " install llama.cpp's llama-server (a release unpacked in /opt/llama.cpp, or"
        " [engines] llama_server = its path) or vLLM (vllm on the agent's PATH), then"
        " check again"
    )


def _running_agent(state_dir: Path) -> int | None:
    """The pid an agent on ``state_dir`` wrote in its lock file, if that process is an
    llmgw agent still. Read only: taking the lock, even for an instant, could make an
    agent starting then refuse to run."""
    try:
        pid = int((state_dir / LOCK_FILE).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    words = {Path(w.decode(errors="replace")).name for w in cmdline}
    return pid if "agent" in words and any("llmgw" in w for w in words) else None


def _issued_by(cert: Path, ca: Path) -> bool:
    """Whether ``cert`` is signed by one of the certificates in ``ca`` (both already
    read and checked by ``client_context``)."""
    leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    for issuer in x509.load_pem_x509_certificates(ca.read_bytes()):
        try:
            leaf.verify_directly_issued_by(issuer)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}".removesuffix(".0") + " GiB"
