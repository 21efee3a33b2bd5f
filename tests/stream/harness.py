"""An in-process control plane and agents over real TLS on loopback."""

from __future__ import annotations

import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio
from trio_websocket import WebSocketConnection, wrap_client_stream

from llmgw.agent.inventory import InventorySource
from llmgw.agent.stream import AgentStream, StreamSettings
from llmgw.agent.supervisor import Supervisor, SupervisorSettings
from llmgw.config.schema import DiscoveryConfig, InventoryOverrides, WeightsConfig
from llmgw.controlplane.nodes import LivenessPolicy
from llmgw.controlplane.service import ControlPlane
from llmgw.controlplane.stream import AgentStreamServer, StreamLimits
from llmgw.protocol import SUBPROTOCOL
from llmgw.tls import client_context, server_context
from llmgw.wsio import single_error
from tests.conftest import Pki


@attrs.define
class Plane:
    control: ControlPlane
    server: AgentStreamServer
    port: int
    pki: Pki

    def agent(
        self,
        node: str,
        *,
        cert: tuple[Path, Path] | None = None,
        memory_gb: float | None = None,
        backoff: float = 0.05,
        state_dir: Path | None = None,
    ) -> AgentStream:
        """An agent whose supervisor runs no engines until the test runs it (``supervised``)."""
        c, k = cert or self.pki.agent(node)
        settings = StreamSettings(
            node_id=node,
            control_plane=[("127.0.0.1", self.port)],
            ssl_context=client_context(self.pki.ca, c, k),
            connect_timeout=2,
            handshake_timeout=1,
            backoff_initial=backoff,
            backoff_max=backoff * 4,
        )
        overrides = InventoryOverrides(memory_gb=memory_gb)
        discovery = DiscoveryConfig(nvidia_smi="/nonexistent/nvidia-smi", llama_server_search=[])
        weights = WeightsConfig(default_dir="/nonexistent/weights")
        source = InventorySource(
            overrides, ("127.0.0.1", self.port), discovery=discovery, weights=weights
        )
        supervisor = Supervisor(
            SupervisorSettings(
                state_dir=state_dir or Path(tempfile.mkdtemp(prefix=f"{node}-", dir=self.pki.dir)),
                kill_unidentified=False,
                nvidia_smi="/nonexistent/nvidia-smi",
            ),
            dict,
        )
        return AgentStream(settings, source, supervisor)

    def refusals(self, reason: str) -> float:
        value = self.control.metrics.registry.get_sample_value(
            "llmgw_agent_stream_refusals_total", {"reason": reason}
        )
        return value or 0.0


@asynccontextmanager
async def control_plane(
    pki: Pki,
    *,
    heartbeat: float = 0.1,
    unreachable_after: float = 1.0,
    lost_after: float = 3.0,
    handshake_timeout: float = 1.0,
    max_message_bytes: int = 64 * 1024,
) -> AsyncIterator[Plane]:
    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=unreachable_after, lost_after=lost_after),
        heartbeat_interval=heartbeat,
    )
    server = AgentStreamServer(
        control,
        server_context(pki.ca, pki.server_cert, pki.server_key),
        StreamLimits(
            handshake_timeout=handshake_timeout,
            idle_timeout=lost_after,
            send_timeout=1.0,
            max_message_bytes=max_message_bytes,
        ),
    )
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(server.serve, "127.0.0.1", 0)
        await nursery.start(control.run_liveness)
        port = listeners[0].socket.getsockname()[1]
        yield Plane(control, server, port, pki)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def supervised(agent: AgentStream) -> AsyncIterator[AgentStream]:
    """The agent's supervisor and stream running, as the agent daemon runs them."""
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.supervisor.run)
        nursery.start_soon(agent.run)
        yield agent
        nursery.cancel_scope.cancel()


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


@asynccontextmanager
async def raw_ws(
    plane: Plane,
    *,
    cert: tuple[Path, Path] | None = None,
    subprotocols: list[str] | None = None,
) -> AsyncIterator[WebSocketConnection]:
    """A hand-driven WebSocket client with a real client certificate."""
    c, k = cert or plane.pki.agent("n3")
    ctx = client_context(plane.pki.ca, c, k)
    tcp = await trio.open_tcp_stream("127.0.0.1", plane.port)
    tls = trio.SSLStream(tcp, ctx, server_hostname="127.0.0.1")
    with single_error():
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(
                nursery,
                tls,
                "127.0.0.1",
                "/agent",
                subprotocols=[SUBPROTOCOL] if subprotocols is None else subprotocols,
                max_message_size=1 << 24,
            )
            yield ws
            nursery.cancel_scope.cancel()


def bare_client_context(pki: Pki) -> ssl.SSLContext:
    """Trusts the CA but presents no client certificate."""
    return ssl.create_default_context(cafile=str(pki.ca))
