"""Failures at start and on the agent's connection, read where an operator reads them.

Each is a real ``llmgw`` process. A daemon that cannot start exits 2 with one line
naming the cause and what to do, never a traceback; an agent that cannot reach or
trust the control plane says which, and the control plane says what it saw.
"""

from __future__ import annotations

import datetime as dt
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from llmgw.router.keys import hash_key, new_key
from llmgw.tls import issue_server, load_ca
from tests.cluster.procs import Daemon, Server, write_agent_config, write_server_config
from tests.conftest import Pki

IN_USE = "address already in use; stop what holds it or choose another port"


@contextmanager
def held_port() -> Iterator[int]:
    """A loopback port a listening socket of ours holds (without SO_REUSEPORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


async def exit_code(daemon: Daemon, timeout: float = 20) -> int:
    with trio.move_on_after(timeout):
        while (code := daemon.returncode()) is None:
            await trio.sleep(0.05)
        return code
    daemon.kill()
    raise AssertionError(f"{daemon.name} did not exit:\n{daemon.log()}")


def refused_at_start(daemon: Daemon, program: str) -> str:
    """The one line a daemon refused at start prints; nothing else of it is an error."""
    text = daemon.log()
    assert "Traceback" not in text, text
    lines = [x for x in text.splitlines() if x.startswith(f"{program}: ")]
    assert len(lines) == 1, text
    assert text.rstrip().endswith(lines[0]), text  # the last word
    return lines[0][len(program) + 2 :]


def server_config(tmp_path: Path, pki: Pki, extra: str = "", **files: Path) -> None:
    config = write_server_config(tmp_path, pki)
    text = config.read_text()
    for name, path in files.items():  # cert=..., key=...
        text = re.sub(rf'^{name} = ".*"$', f'{name} = "{path}"', text, flags=re.MULTILINE)
    config.write_text(text + extra)


def agent(tmp_path: Path, pki: Pki, port: int, extra: str = "", top: str = "") -> Daemon:
    config = write_agent_config(
        tmp_path, pki, "n1", port, extra='[discovery]\nnvidia_smi = "/nonexistent"\n' + extra
    )
    config.write_text(top + config.read_text())
    return Daemon("agent-n1", ["agent", "--config", config.name], tmp_path)


# --------------------------------------------------------------------------- listeners


@pytest.mark.parametrize("key", ["agent_stream.listen", "admin.listen", "router.listen"])
async def test_a_server_port_in_use_is_one_line_naming_it(
    tmp_path: Path, pki: Pki, key: str
) -> None:
    with held_port() as port:
        server_config(tmp_path, pki, '[router]\nlisten = "127.0.0.1:0"\n')
        server = Daemon(
            "server",
            ["server", "--config", "server.toml", "--set", f'{key}="127.0.0.1:{port}"'],
            tmp_path,
        ).start()
        assert await exit_code(server) == 2
    line = refused_at_start(server, "llmgw server")
    assert line == f"cannot listen on 127.0.0.1:{port} ({key}): {IN_USE}"


async def test_an_address_this_machine_does_not_have_is_one_line(tmp_path: Path, pki: Pki) -> None:
    server_config(tmp_path, pki)
    server = Daemon(
        "server", ["server", "--config", "server.toml", "--agent-listen", "192.0.2.1:0"], tmp_path
    ).start()  # TEST-NET-1: on no interface; binding to it sends nothing
    assert await exit_code(server) == 2
    line = refused_at_start(server, "llmgw server")
    assert line.startswith("cannot listen on 192.0.2.1:0 (agent_stream.listen): no interface")


async def test_an_agents_metrics_port_in_use_is_one_line(tmp_path: Path, pki: Pki) -> None:
    with held_port() as port:
        daemon = agent(tmp_path, pki, port, f'[metrics]\nlisten = "127.0.0.1:{port}"\n').start()
        assert await exit_code(daemon) == 2
    assert refused_at_start(daemon, "llmgw agent") == (
        f"cannot listen on 127.0.0.1:{port} (metrics.listen): {IN_USE}"
    )


async def test_a_standalone_routers_port_in_use_is_one_line(tmp_path: Path) -> None:
    with held_port() as port:
        (tmp_path / "router.toml").write_text(
            f'admin_url = "http://127.0.0.1:{port}"\nadmin_token = "t"\nworkers = 2\n'
            f'[router]\nlisten = "127.0.0.1:{port}"\n'
            f'[[router.keys]]\nname = "k"\nsha256 = "{hash_key(new_key())}"\n'
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
        assert await exit_code(router) == 2
    # one line: worker 0 is refused before it starts the others
    assert refused_at_start(router, "llmgw router") == (
        f"cannot listen on 127.0.0.1:{port} (router.listen): {IN_USE}"
    )


# --------------------------------------------------------------------------- certificates


async def test_a_key_that_does_not_match_its_certificate_is_named_with_it(
    tmp_path: Path, pki: Pki
) -> None:
    _, wrong_key = pki.agent("n1")
    server_config(tmp_path, pki, key=wrong_key)
    server = Daemon("server", ["server", "--config", "server.toml"], tmp_path).start()
    assert await exit_code(server) == 2
    line = refused_at_start(server, "llmgw server")
    assert line.startswith(f"key {wrong_key} does not match certificate {pki.server_cert}: ")

    cert, _ = pki.agent("n1")
    _, other_key = pki.agent("n2")
    config = write_agent_config(tmp_path, pki, "n1", 1)
    config.write_text(config.read_text().replace(str(pki.agent("n1")[1]), str(other_key)))
    daemon = Daemon("agent-n1", ["agent", "--config", config.name], tmp_path).start()
    assert await exit_code(daemon) == 2
    line = refused_at_start(daemon, "llmgw agent")
    assert line.startswith(f"key {other_key} does not match certificate {cert}: ")


async def refused_server_certificate(
    tmp_path: Path, pki: Pki, cert: Path, key: Path
) -> tuple[str, str, int]:
    """A server presenting ``cert`` and an agent dialing it at 127.0.0.1: what each says."""
    server_config(tmp_path, pki, cert=cert, key=key)
    server = Server("server", ["server", "--config", "server.toml"], tmp_path).start()
    daemon = None
    try:
        await server.ready()
        port = server.stream_port
        daemon = agent(tmp_path, pki, port).start()
        m = await daemon.wait_log(r"ERROR llmgw\.agent: (.*)")
        await server.wait_log(r"WARNING llmgw\.controlplane\.stream: agent from")
        return m.group(1), server.log(), port
    finally:
        for d in (daemon, server):
            if d is not None:
                d.kill()


async def test_a_server_certificate_without_the_dialed_address_says_what_it_holds(
    tmp_path: Path, pki: Pki
) -> None:
    cert, key = issue_server(
        load_ca(pki.dir), ["cp.example.net", "10.9.9.9"], tmp_path, name="elsewhere"
    )
    said, server_log, port = await refused_server_certificate(tmp_path, pki, cert, key)
    assert said.startswith(
        f"control plane 127.0.0.1:{port} presented a certificate that is not valid for 127.0.0.1"
        " (it holds "
    ), said
    assert "cp.example.net" in said and "10.9.9.9" in said
    assert re.search(r"llmgw ctl cert server 127\.0\.0\.1 \S+ \S+ --dir pki$", said), said
    assert re.search(
        r"WARNING llmgw\.controlplane\.stream: agent from 127\.0\.0\.1:\d+ dropped the TLS"
        r" handshake: it probably does not trust this server's certificate"
        r" \(see the agent's log\)",
        server_log,
    ), server_log
    # the agent's second look at the certificate costs the server no line of its own
    warnings = [x for x in server_log.splitlines() if "WARNING llmgw.controlplane" in x]
    assert all("dropped the TLS handshake" in x for x in warnings), warnings
    assert "UNEXPECTED_EOF" not in server_log


async def test_a_server_certificate_from_another_ca_names_the_ca_file(
    tmp_path: Path, pki: Pki
) -> None:
    cert, key = issue_server(
        load_ca(pki.other_ca_dir), ["127.0.0.1", "localhost"], tmp_path, name="foreign"
    )
    said, server_log, port = await refused_server_certificate(tmp_path, pki, cert, key)
    assert said.startswith(
        f"control plane 127.0.0.1:{port} presented a certificate that is not signed by the CA"
        f" in {pki.ca} (this agent's ca): "
    ), said
    assert "CERTIFICATE_VERIFY_FAILED" not in said
    assert "dropped the TLS handshake" in server_log


async def test_an_expired_server_certificate_says_so(tmp_path: Path, pki: Pki) -> None:
    now = dt.datetime.now(dt.UTC)
    cert, key = issue_server(
        load_ca(pki.dir),
        ["127.0.0.1"],
        tmp_path,
        name="expired",
        not_before=now - dt.timedelta(days=10),
        not_after=now - dt.timedelta(days=1),
    )
    said, _, port = await refused_server_certificate(tmp_path, pki, cert, key)
    assert said.startswith(
        f"control plane 127.0.0.1:{port} presented a certificate that has expired: "
    ), said


# --------------------------------------------------------------------------- reaching it


async def test_a_refused_connection_asks_whether_the_server_runs(tmp_path: Path, pki: Pki) -> None:
    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        daemon = agent(tmp_path, pki, port).start()
        try:
            m = await daemon.wait_log(r"ERROR llmgw\.agent: (.*)")
        finally:
            daemon.kill()
    assert m.group(1) == (
        f"connection refused by 127.0.0.1:{port}:"
        " is llmgw server running there and listening on that port?"
    )


async def test_a_connection_nobody_answers_says_how_long_it_waited(
    tmp_path: Path, pki: Pki
) -> None:
    with socket.socket() as full, socket.socket() as queued:
        # a listener whose queue is full drops every further SYN, as a firewall would
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        queued.connect(("127.0.0.1", port))
        daemon = agent(tmp_path, pki, port, top="connect_timeout_s = 1\n").start()
        try:
            m = await daemon.wait_log(r"ERROR llmgw\.agent: (.*)")
        finally:
            daemon.kill()
    assert m.group(1) == (
        f"no answer from 127.0.0.1:{port} within 1 s: a firewall, or a wrong address?"
    )
