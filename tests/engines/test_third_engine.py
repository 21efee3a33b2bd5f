"""A third engine, added in this test alone: found, placed, launched, routed and resumed.

llmgw knows an engine only through its adapter, asked through the registry
(``llmgw.engines``). This module defines one for an engine that no part of llmgw
names, the counting engine (``standins/counting.py``: its own command, metric
names, token ids and tokenizer endpoints), and runs a real fleet with it: a
server with its router, and two agents with the engine's command on their PATH.
Each daemon is llmgw with this adapter registered (this module run as ``python
-m``, at its end); the suite's own process registers nothing, so every other
test sees the built-in engines only.

The fleet must find the engine on each node (discovery, by what the adapter
requires), place a replica on each (the catalog and placement, by what it
declares), launch and health-check them (the agent), route a request to one
(the router, reading the engine's own metrics through the adapter) and, when
the engine under a stream dies mid-way, carry the stream on from the other
(resume, through the adapter's ``tokens``): the client reads one unbroken reply.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from llmgw.addr import url_host
from llmgw.agent.procs import identity
from llmgw.engines import adapter, adapters, installed, programs, register, tokens
from llmgw.engines.base import (
    Launch,
    LoadSignals,
    Program,
    Requirements,
    check_port,
    check_sleep,
    sample_values,
)
from llmgw.engines.sizing import Sizing
from llmgw.engines.tokens import Ask, Tokens, token_ids
from llmgw.protocol.messages import ShardSpec
from llmgw.router.keys import hash_key, new_key
from tests.cluster.procs import Daemon, Server, write_agent_config, write_server_config
from tests.conftest import Pki
from tests.engines.test_vllm import STANDINS, wrapper

ROOT = Path(__file__).resolve().parents[2]
COUNTING = Program(name="counting", command="counting")  # `counting --version`: "1.2.3"
PORTS = 24500 + (os.getpid() % 100) * 20  # engine ports: n1 gets PORTS.., n2 PORTS+10..


class CountingTokens:
    """The counting engine's token ids: ``"ids"`` in each streamed choice."""

    family: str = "counting"
    asking: Mapping[str, object] = {"with_ids": True}
    carried: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()

    def took(self, choice: dict[str, Any], keep: bool, chat: bool) -> list[int]:
        return list((choice.get("ids") if keep else choice.pop("ids", None)) or ())

    async def render(
        self, ask: Ask, body: Mapping[str, Any], chat: bool, ids: list[int], relayed: str
    ) -> tuple[list[int], list[int]]:
        if chat:
            prompt = (await ask("/tokenize", {"messages": body["messages"]}))["ids"]
        elif isinstance(body.get("prompt"), list):
            prompt = body["prompt"]
        else:
            prompt = (await ask("/tokenize", {"text": body.get("prompt")}))["ids"]
        text = (await ask("/detokenize", {"ids": ids}))["text"] if ids else ""
        if text != relayed:
            ids = token_ids((await ask("/tokenize", {"text": relayed}))["ids"])
        return token_ids(prompt), ids


class CountingAdapter:
    """``counting serve``, on one node, no GPU, no model file."""

    name = "counting"
    known_settings = frozenset({"delay_s", "crash_once", "crash_after"})
    key_env = "COUNTING_API_KEY"
    requires: Requirements = Requirements(programs=(COUNTING,))
    sizing: Sizing | None = None
    tokens: Tokens | None = CountingTokens()
    usage_path: str | None = None
    sleeps: bool = False
    slot_cache: bool = False
    slot_field: str | None = None

    def validate(self, spec: ShardSpec) -> list[str]:
        problems = [
            f"unknown setting {k!r}" for k in sorted(set(spec.settings) - self.known_settings)
        ]
        check_port(spec, problems)
        if spec.world_size != 1:
            problems.append("the counting engine runs on one node")
        check_sleep(spec, self.name, problems)
        return problems

    def launch(self, spec: ShardSpec, binaries: Mapping[str, str]) -> Launch:
        argv = [binaries[COUNTING.command], "serve", "--model", spec.model]
        argv += ["--host", spec.host, "--port", str(spec.port)]
        for key, value in sorted(spec.settings.items()):
            argv += [f"--{key.replace('_', '-')}", str(value)]
        base = f"http://{url_host(spec.host)}:{spec.port}"
        return Launch(
            argv=argv + spec.engine_args,
            env=dict(spec.env),
            health_url=f"{base}/health",
            metrics_url=f"{base}/metrics",
        )

    def parse_metrics(self, text: str) -> LoadSignals:
        values = sample_values(text)
        return LoadSignals(
            waiting=values.get("counting_waiting"),
            running=values.get("counting_running"),
            progress=values.get("counting_generated_total"),
        )

    def parse_usage(self, body: bytes) -> LoadSignals | None:
        return None

    def parse_sleeping(self, body: bytes) -> bool | None:
        return None


ADAPTER = CountingAdapter()


@attrs.define
class Fleet:
    tmp: Path
    server: Server
    agents: list[Daemon]
    router: str = ""  # the OpenAI-compatible endpoint's base URL
    key: str = ""

    async def ctl(self, *args: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads((await self.server.ctl(*args, "--json")).stdout)
        return found

    async def until(self, what: str, check: Any, timeout: float = 60) -> Any:
        """Poll ``check`` (an async callable) until it gives something true."""
        with trio.move_on_after(timeout):
            while True:
                found = await check()
                if found:
                    return found
                await trio.sleep(0.2)
        logs = "\n".join(f"--- {d.name}\n{d.log()[-3000:]}" for d in [self.server, *self.agents])
        raise AssertionError(f"never {what}\n{logs}")


@asynccontextmanager
async def counting_fleet(tmp_path: Path, pki: Pki) -> AsyncIterator[Fleet]:
    """A server whose catalog runs two replicas of ``counter`` on the counting engine
    (the one whose stream reaches 5 tokens first dies there, once), and two agents."""
    bin_dir = tmp_path / "bin"
    wrapper(bin_dir, "counting")
    settings = f'{{ delay_s = 0.05, crash_once = "{tmp_path / "crashed"}", crash_after = 5 }}'
    (tmp_path / "catalog.toml").write_text(
        "[models.counter]\nreplicas = 2\n[[models.counter.profiles]]\n"
        f'name = "any"\nengine = "counting"\nsettings = {settings}\nstartup_timeout_s = 30\n'
    )
    key = new_key()
    config = write_server_config(tmp_path, pki, heartbeat=0.2, unreachable_after=2, lost_after=6)
    config.write_text(
        'catalog = "catalog.toml"\nlog_level = "info"\n'
        + config.read_text()
        + "[reconcile]\nsettle_s = 1\n"
        + '[router]\nlisten = "127.0.0.1:0"\n'
        + f'[[router.keys]]\nname = "tester"\nsha256 = "{hash_key(key)}"\n'
    )
    # the daemons import this module, from this checkout
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    here = {"PYTHONPATH": path}
    module = "tests.engines.test_third_engine"
    server = Server("server", ["server", "--config", "server.toml"], tmp_path, here, module=module)
    fleet = Fleet(tmp_path, server, [], key=key)
    try:
        await server.start().ready()
        for i, node in enumerate(("n1", "n2")):
            low = PORTS + 10 * i
            extra = (
                f"[engines]\nport_range = [{low}, {low + 9}]\nkill_unidentified = false\n"
                'stop_grace_s = 2\n[discovery]\nnvidia_smi = "/nonexistent"\n'
            )
            agent_config = write_agent_config(
                tmp_path, pki, node, server.stream_port, memory_gb=16, extra=extra
            )
            env = {**here, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
            args = ["agent", "--config", agent_config.name]
            fleet.agents.append(Daemon(f"agent-{node}", args, tmp_path, env, module=module).start())
        m = await server.wait_log(r"OpenAI-compatible endpoint on (http://127\.0\.0\.1:\d+/v1)")
        fleet.router = m.group(1)
        yield fleet
    finally:
        for d in [server, *fleet.agents]:
            d.kill()
        for record in tmp_path.glob("agent-*/shards/*.json"):  # engines outlive agents
            try:
                os.killpg(json.loads(record.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_the_registry_answers_for_the_built_in_engines_and_keeps_names_unique() -> None:
    """What the rest of llmgw asks, for the engines llmgw ships; a second adapter of a
    name is refused and changes nothing."""
    assert list(adapters()) == ["llama.cpp", "vllm", "vllm-ray"]
    assert [p.name for p in programs()] == ["llama.cpp", "vllm", "ray"]
    assert installed("vllm-ray") == ("vllm", "ray") and installed("sglang") == ("sglang",)
    assert [tokens(e).family for e in adapters() if tokens(e)] == ["llama.cpp", "vllm", "vllm"]
    clash = CountingAdapter()
    clash.name = "vllm"
    with pytest.raises(ValueError, match="'vllm' is registered already"):
        register(clash)
    assert adapter("vllm") is not clash and "counting" not in adapters()


async def test_a_third_engine_is_found_placed_launched_routed_and_resumed(
    tmp_path: Path, pki: Pki
) -> None:
    async with counting_fleet(tmp_path, pki) as fleet:

        async def found() -> bool:
            nodes = (await fleet.ctl("nodes"))["nodes"]
            return len(nodes) == 2 and all(n["engines"].get("counting") == "1.2.3" for n in nodes)

        await fleet.until("found the counting engine on both nodes", found)

        async def ready() -> list[dict[str, Any]]:
            replicas = (await fleet.ctl("replicas"))["replicas"]
            up = [r for r in replicas if r["model"] == "counter" and r["state"] == "Ready"]
            return up if len(up) == 2 else []

        replicas = await fleet.until("two Ready replicas", ready)
        assert sorted(s["node_id"] for r in replicas for s in r["shards"]) == ["n1", "n2"]
        for record in tmp_path.glob("agent-*/shards/*.json"):  # launched as the adapter said
            who = identity(json.loads(record.read_text())["pid"])
            assert who is not None and who.cmdline[1] == str(STANDINS / "counting.py"), who
            assert who.cmdline[2:5] == ("serve", "--model", "counter"), who.cmdline

        auth = {"authorization": f"Bearer {fleet.key}"}
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:

            async def listed() -> bool:
                r = await client.get(fleet.router + "/models", headers=auth)
                return r.status_code == 200 and "counter" in [m["id"] for m in r.json()["data"]]

            await fleet.until("the router lists counter", listed)
            chat = {"model": "counter", "messages": [{"role": "user", "content": "count"}]}
            r = await client.post(
                fleet.router + "/chat/completions", headers=auth, json={**chat, "max_tokens": 3}
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == " w0 w1 w2"

            # a stream whose engine dies after 5 tokens goes on from the other replica
            chunks: list[dict[str, Any]] = []
            done = False
            body = {**chat, "max_tokens": 12, "stream": True}
            async with client.stream(
                "POST", fleet.router + "/chat/completions", headers=auth, json=body
            ) as stream:
                assert stream.status_code == 200
                async for line in stream.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunks.append(json.loads(line[6:]))
        assert (tmp_path / "crashed").exists()  # one engine died under the stream
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert text == "".join(f" w{k}" for k in range(12)), chunks
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len({c["id"] for c in chunks}) == 1  # one stream, under one id
        assert not any("ids" in c["choices"][0] for c in chunks if c["choices"])
        said = await fleet.server.wait_log(
            r"stream \S+ of counter broke mid-way on replica \S+; replica \S+ carries it on "
            r"from token 5"
        )
        assert said


if __name__ == "__main__":  # the test's daemons: llmgw with the counting engine's adapter
    register(ADAPTER)
    from llmgw.cli import main

    main()
