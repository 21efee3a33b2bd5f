"""Reloading without a restart, through real processes: `llmgw ctl reload` and SIGHUP
read the API keys again along with the catalog, in the server's in-process router
and in a standalone `llmgw router`; a bad config file changes nothing."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam

from llmgw.engines import adapters
from llmgw.router.keys import hash_key, new_key
from tests.cluster.procs import Daemon, workers_route
from tests.cluster.test_control_plane_processes import cluster
from tests.cluster.test_router_processes import reserved_port, routed, stopped_with_sigterm
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def key_entry(name: str, key: str, models: list[str] | None = None) -> str:
    allowed = "" if models is None else f"models = {json.dumps(models)}\n"
    return f'[[router.keys]]\nname = "{name}"\nsha256 = "{hash_key(key)}"\n{allowed}'


async def chat(base: str, key: str, model: str = "tiny") -> httpx.Response:
    async with httpx.AsyncClient(timeout=20) as client:
        return await client.post(
            base + "/chat/completions",
            json={"model": model, "messages": HI, "max_tokens": 4},
            headers={"authorization": f"Bearer {key}"},
        )


async def test_ctl_reload_and_sighup_reload_the_keys_of_the_in_process_router(
    tmp_path: Path, pki: Pki
) -> None:
    old, new, later = new_key(), new_key(), new_key()
    async with routed(tmp_path, pki, extra_keys=key_entry("old", old)) as (c, base, key):
        config = tmp_path / "server.toml"
        assert (await chat(base, old)).status_code == 200
        assert (await chat(base, new)).status_code == 401  # not there yet

        # "old" goes, "new" comes, limited to a model that has no replica
        config.write_text(
            config.read_text().replace(key_entry("old", old), key_entry("new", new, ["huge"]))
        )
        out = (await c.server.ctl("reload")).stdout.decode()
        assert "catalog reloaded from" in out
        assert "keys reloaded: 2 keys (added new; removed old)" in out, out
        await c.server.wait_log(r"keys reloaded: 2 keys \(added new; removed old\)")

        gone = openai.AsyncOpenAI(base_url=base, api_key=old, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await gone.chat.completions.create(model="tiny", messages=HI, max_tokens=4)
        limited = openai.AsyncOpenAI(base_url=base, api_key=new, max_retries=0)
        # a model the key may not use: 403, in OpenAI's format, naming the key
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await limited.chat.completions.create(model="tiny", messages=HI, max_tokens=4)
        body = denied.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_allowed", body
        assert "'new' may not use the model 'tiny'" in body["message"]
        with pytest.raises(openai.PermissionDeniedError):
            await limited.models.retrieve("tiny")
        # a model nobody knows stays 404, whatever the key may use
        with pytest.raises(openai.NotFoundError):
            await limited.chat.completions.create(model="nope", messages=HI, max_tokens=4)
        assert [m.id for m in (await limited.models.list()).data] == []
        assert (await chat(base, key)).status_code == 200  # the unchanged key still works

        # a bad config file keeps the keys and the catalog, and says why in one line
        good = config.read_text()
        config.write_text(good + "[router.nope]\n")
        bad = await c.server.ctl("reload", check=False)
        assert bad.returncode == 2
        why = bad.stderr.decode().strip()
        assert len(why.splitlines()) == 1, why
        assert "config not reloaded, nothing changed" in why and "server.toml" in why, why
        assert "router" in why and "nope" in why, why
        assert (await chat(base, new, "nope")).status_code == 404
        assert (await chat(base, new)).status_code == 403  # the keys are still the last good

        # SIGHUP reads them too
        config.write_text(good + key_entry("later", later))
        assert c.server.proc is not None
        c.server.proc.send_signal(signal.SIGHUP)
        await c.server.wait_log(r"keys reloaded: 3 keys \(added later\)")
        assert (await chat(base, later)).status_code == 200
        assert c.server.returncode() is None
        log = c.server.log()
        assert "Traceback" not in log
        assert not any(k in log for k in (key, old, new, later))


async def test_sighup_reloads_the_keys_of_every_standalone_router_worker(
    tmp_path: Path, pki: Pki
) -> None:
    async with routed(tmp_path, pki) as (c, _, key):
        held = reserved_port()
        port = held.getsockname()[1]
        config = tmp_path / "router.toml"
        text = (
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            "workers = 2\n"
            f'[router]\nlisten = "127.0.0.1:{port}"\n' + key_entry("edge", key)
        )
        config.write_text(text)
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
        c.agents["router"] = router  # killed with the rest
        base = f"http://127.0.0.1:{port}/v1"
        await workers_route(router, 1)  # both workers
        other = new_key()
        assert (await chat(base, other)).status_code == 401

        config.write_text(text + key_entry("other", other, ["tiny"]))
        assert router.proc is not None
        router.proc.send_signal(signal.SIGHUP)
        await router.wait_log(r"keys reloaded: 2 keys \(added other\)", count=2)  # both workers
        for _ in range(6):  # connections land on both workers
            assert (await chat(base, other)).status_code == 200

        config.write_text("workers = [\n")  # a bad file: nothing changes, one line says why
        router.proc.send_signal(signal.SIGHUP)
        m = await router.wait_log(r".*keys not reloaded, nothing changed: .*", count=2)
        assert "router.toml" in m.group(0)
        await trio.sleep(0.2)
        for _ in range(4):
            assert (await chat(base, other)).status_code == 200
        assert router.returncode() is None
        assert "Traceback" not in router.log()
        assert len(re.findall("keys not reloaded", router.log())) == 2
        await router.stop(signal.SIGTERM)
        held.close()


async def _status_within(base: str, key: str, status: int, within: float) -> float:
    """Seconds until a chat with ``key`` through ``base`` answers ``status``; fails
    past ``within``."""
    start = trio.current_time()
    while True:
        got = (await chat(base, key)).status_code
        took = trio.current_time() - start
        if got == status:
            return took
        assert took < within, f"still {got} after {took:.2f} s, not {status}"
        await trio.sleep(0.02)


async def test_a_key_reloaded_on_the_server_reaches_every_standalone_router_worker(
    tmp_path: Path, pki: Pki
) -> None:
    """One place to add a key: the server's config and ``ctl reload``. A standalone
    router takes the control plane's keys (hashes, with the routing) besides its own,
    a new one within a second and a removed one likewise."""
    edge = new_key()
    async with routed(tmp_path, pki) as (c, _, key):  # the server's config holds "tester"
        held = reserved_port()
        port = held.getsockname()[1]
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            "workers = 2\n"
            f'[router]\nlisten = "127.0.0.1:{port}"\n' + key_entry("edge", edge)
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path)
        async with stopped_with_sigterm(router.start()):
            base = f"http://127.0.0.1:{port}/v1"
            await workers_route(router, 1)
            for _ in range(4):  # connections land on both workers: its own key, and the server's
                assert (await chat(base, edge)).status_code == 200
                assert (await chat(base, key)).status_code == 200
            await router.wait_log(r"keys from the control plane: 1 key \(added tester\)")

            added = new_key()
            assert (await chat(base, added)).status_code == 401
            config = tmp_path / "server.toml"
            before = config.read_text()
            config.write_text(before + key_entry("added", added, ["tiny"]))
            out = (await c.server.ctl("reload")).stdout.decode()
            assert "keys reloaded: 2 keys (added added)" in out, out
            took = await _status_within(base, added, 200, within=1.0)
            for _ in range(6):  # every worker has it
                assert (await chat(base, added)).status_code == 200
            await router.wait_log(r"keys from the control plane: 2 keys \(added added\)")

            config.write_text(before)  # removed on the server: refused by every worker
            await c.server.ctl("reload")
            took = max(took, await _status_within(base, added, 401, within=1.0))
            for _ in range(6):
                assert (await chat(base, added)).status_code == 401
                assert (await chat(base, edge)).status_code == 200  # its own stays
            assert added not in router.log() and hash_key(added) not in router.log()
        held.close()
    print(f"a reloaded key reached the router in {took:.2f} s at most")


async def test_a_router_with_no_key_anywhere_refuses_every_request_and_says_so(
    tmp_path: Path, pki: Pki
) -> None:
    """A standalone router with no key of its own, following a server with none: it is
    never an open endpoint; it says what to do, and a key added on the server lets
    clients in."""
    async with cluster(tmp_path, pki) as c:
        held = reserved_port()
        port = held.getsockname()[1]
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            f'[router]\nlisten = "127.0.0.1:{port}"\n'
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path)
        async with stopped_with_sigterm(router.start()):
            base = f"http://127.0.0.1:{port}/v1"
            await router.wait_log(
                r"no API keys, neither in this router's config nor in the control"
            )
            key = new_key()
            assert (await chat(base, key)).status_code == 401
            config = tmp_path / "server.toml"
            config.write_text(config.read_text() + key_entry("first", key))
            await c.server.ctl("reload")
            await router.wait_log(r"keys from the control plane: 1 key \(added first\)")
            assert (await chat(base, key)).status_code != 401  # in: tiny has no replica yet
            assert router.log().count("no API keys") == 1
        held.close()


TYPO = """
[models.typo]
replicas = 0
[[models.typo.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/nonexistent/typo.gguf"
settings = { contxt = 512, parallel = 1, flash = true }
"""

TOO_BIG = """
[models.toobig]
[[models.toobig.profiles]]
name = "cpu"
engine = "llama.cpp"
min_memory_gb = 1000
model_path = "/nonexistent/big.gguf"
"""


async def test_ctl_reload_warns_about_unknown_settings_and_models_no_node_can_hold(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki, extra_catalog=TYPO) as c:
        known = ", ".join(sorted(adapters()["llama.cpp"].known_settings))  # as the server says
        bad_settings = [
            f"model typo, profile cpu: llama.cpp does not know the setting {name!r}"
            f" (it knows {known})"
            for name in ("contxt", "flash")
        ]
        # at start: one warning line for each
        for line in bad_settings:
            await c.server.wait_log(r"WARNING.*" + re.escape(line) + "\n")
        assert len(re.findall("does not know the setting", c.server.log())) == 2

        # before any node: nothing can be said about placement, and ctl says that
        result = await c.server.ctl("reload")
        lines = result.stdout.decode().splitlines()
        assert lines[0].startswith("catalog reloaded from "), lines
        assert lines[1:] == [
            *(f"warning: {w}" for w in bad_settings),
            "warning: no node has registered yet: whether the catalog's models can be"
            " placed is not known",
        ], lines

        c.agent("n1", memory_gb=16)
        await c.wait_ready(1)
        catalog = tmp_path / "catalog.toml"
        catalog.write_text(catalog.read_text() + TOO_BIG)
        result = await c.server.ctl("reload")
        assert result.returncode == 0  # warnings are no failure
        lines = result.stdout.decode().splitlines()
        assert lines[0].endswith(": 4 models"), lines
        assert lines[1:3] == [f"warning: {w}" for w in bad_settings], lines
        # tiny has its replica, huge wants none: only toobig cannot be placed
        assert len(lines) == 4, lines
        assert lines[3].startswith("warning: cannot place toobig now: no node can hold toobig:")
        assert "n1: has 16" in lines[3] and "needs 1000" in lines[3], lines
        # one log line says it all
        m = await c.server.wait_log(r"WARNING .*catalog reloaded .*: 4 models; warnings: (.*)")
        assert "cannot place toobig now" in m.group(1) and "'contxt'" in m.group(1)

        as_json = json.loads((await c.server.ctl("reload", "--json")).stdout)
        assert as_json["message"].startswith("catalog reloaded from ")
        assert as_json["warnings"] == [w.removeprefix("warning: ") for w in lines[1:]]
