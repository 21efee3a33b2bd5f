"""Weights a node lacks are fetched before its engine starts, through real processes:
the control plane, a real agent, a real llama-server, and the hub stand-in serving
the tiny model as the hub would (huggingface_hub in the agent, pointed at it by
``HF_ENDPOINT``). A profile that names a ``source`` instead of a ``model_path`` is
placed on a node without the file; the agent fetches it (slowly: longer than the
startup timeout, which counts only from when it is whole), reports how far it has
come, and starts the engine, which serves. A fetch whose bytes are not the ones
the profile pins fails the replica in one line, and lands nothing."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import httpx
import msgspec
import trio

from llmgw.protocol.messages import ShardSpec, StartShard, StopShard
from tests.cluster.test_control_plane_processes import Cluster, chat, cluster
from tests.cluster.test_engine_processes import PORT_BASE, fleet, llama_spec
from tests.conftest import Pki
from tests.engines.test_vllm import wrapper
from tests.realparts import needs_server
from tests.stream.harness import wait_for
from tests.weights.test_fetch_repo import write_repo
from tools.support.hubstandin import CHUNK, HubStandIn
from tools.support.tinymodel import write_model

pytestmark = needs_server

FETCH_S = 6.0  # how long the stand-in takes to serve the file: past the startup timeout


def model_entry(name: str, source: str, replicas: int, more: str = "") -> str:
    """A catalog model of one llama.cpp profile that fetches ``source``."""
    return f"""
[models.{name}]
replicas = {replicas}
[[models.{name}.profiles]]
name = "cpu"
engine = "llama.cpp"
gpus = 1
min_memory_gb = 1
source = "{source}"
settings = {{ context = 256, parallel = 1, threads = 1, threads_batch = 1 }}
{more}"""


def fetched(source: str, sha256: str = "", startup_timeout_s: float = 3, replicas: int = 1) -> str:
    pin = f'sha256 = "{sha256}"\n' if sha256 else ""
    more = f"{pin}fetch_stall_s = 10\nstartup_timeout_s = {startup_timeout_s}\n"
    return model_entry("fetched", source, replicas, more)


def hub_env(tmp: Path, hub: HubStandIn) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf-home"), "HF_TOKEN": ""}


def serve_model(tmp: Path) -> tuple[Path, Path]:
    """The stand-in's folder, and the tiny model in it as acme/tiny-GGUF's tiny.gguf."""
    root = tmp / "hub"
    file = root / "acme" / "tiny-GGUF" / "tiny.gguf"
    file.parent.mkdir(parents=True)
    write_model(file, ends_after=4, context_length=256)
    return root, file


async def agent_metrics(c: Cluster, node: str) -> str:
    """NODE's agent's /metrics, where its log says it serves them."""
    port = c.agents[node].log().split("metrics on http://127.0.0.1:")[1].split("/")[0]
    async with httpx.AsyncClient(timeout=5) as client:
        return (await client.get(f"http://127.0.0.1:{port}/metrics")).text


async def test_a_replica_placed_where_its_weights_are_not_fetches_them_and_serves(
    tmp_path: Path, pki: Pki
) -> None:
    root, file = serve_model(tmp_path)
    size = file.stat().st_size
    source = "hf://acme/tiny-GGUF/tiny.gguf"
    with HubStandIn(root) as hub:
        hub.rate = int(size / FETCH_S)
        # within [reconcile]: a replica not ready 1 s past its startup timeout fails
        margin = "startup_margin_s = 1\n"
        async with cluster(
            tmp_path, pki, 0, extra_catalog=fetched(source), server_extra=margin
        ) as c:
            landing = tmp_path / "fetched-weights"
            c.agent(
                "n1",
                env=hub_env(tmp_path, hub),
                more=f'[weights]\ndefault_dir = "{landing}"\n[metrics]\nlisten = "127.0.0.1:0"\n',
            )
            # while it fetches: ctl says how far, on which node, and nothing times out
            seen = await until_fetching(c)
            assert "fetching" in seen["models"] and "on n1" in seen["models"], seen
            assert f"fetching {source}: " in seen["replicas"], seen
            assert "% of" in seen["replicas"], seen
            (ready,) = await c.wait_ready(1, timeout=FETCH_S * 4, model="fetched")
            # placed once: the fetch did not count against its 3 s startup timeout
            assert not [r for r in await c.replicas() if r["state"] == "Failed"]
            log = c.server.log()
            assert "not ready" not in log, log[-3000:]
            await chat(tmp_path, ready["shards"][0])

            # it landed whole where its source lands, with its source beside it
            target = landing / "hf" / "acme" / "tiny-GGUF" / "main" / "tiny.gguf"
            assert hashlib.sha256(target.read_bytes()).digest() == (
                hashlib.sha256(file.read_bytes()).digest()
            )
            assert (target.parent / ".tiny.gguf.source").read_text().strip() == source
            assert not list(target.parent.glob("*.part"))
            # the node reports it held, with its source: placement knows it is here
            n1 = (await c.server.nodes())["n1"]
            copies = [w for w in n1["weights"] if w.get("source") == source]
            assert copies and copies[0]["path"] == str(target), n1["weights"]
            assert n1["weights_dir"] == str(landing), n1
            # counted by where the bytes came from
            agent_log = c.agents["n1"].log()
            text = await agent_metrics(c, "n1")
            assert f'llmgw_agent_weights_fetched_bytes_total{{source="hub"}} {size:.1f}' in text
            assert "fetching hf://acme/tiny-GGUF/tiny.gguf" in agent_log, agent_log[-3000:]
            assert hub.served == size  # read once


async def until_fetching(c: Cluster) -> dict[str, str]:
    """``ctl models`` and ``ctl replicas`` while the replica's weights are being fetched."""
    with trio.fail_after(FETCH_S * 2):
        while True:
            replicas = (await c.server.ctl("replicas")).stdout.decode()
            if "% of" in replicas:
                models = (await c.server.ctl("models")).stdout.decode()
                return {"replicas": replicas, "models": models}
            await trio.sleep(0.2)


async def test_a_fetch_of_other_bytes_than_pinned_fails_the_replica_and_lands_nothing(
    tmp_path: Path, pki: Pki
) -> None:
    root, _ = serve_model(tmp_path)
    source = "hf://acme/tiny-GGUF/tiny.gguf"
    wrong = "0" * 64
    with HubStandIn(root) as hub:
        catalog = fetched(source, sha256=wrong)
        async with cluster(tmp_path, pki, 0, extra_catalog=catalog) as c:
            landing = tmp_path / "fetched-weights"
            c.agent(
                "n1", env=hub_env(tmp_path, hub), more=f'[weights]\ndefault_dir = "{landing}"\n'
            )
            line = await c.server.wait_log(r"shard (\S+) failed: cannot fetch its weights: (.*)")
            assert wrong in line.group(2) and "pin the revision" in line.group(2), line.group(0)
            assert not (landing / "hf" / "acme" / "tiny-GGUF" / "main" / "tiny.gguf").exists()
            models = json.loads((await c.server.ctl("models", "--json")).stdout)["models"]
            (view,) = [m for m in models if m["model"] == "fetched"]
            reasons = [f["reason"] for f in view["failures"]]
            assert any("cannot fetch its weights" in r for r in reasons), view


async def test_prefetch_warms_nodes_before_a_replica_needs_them(tmp_path: Path, pki: Pki) -> None:
    root, file = serve_model(tmp_path)
    size = file.stat().st_size
    source = "hf://acme/tiny-GGUF/tiny.gguf"
    with HubStandIn(root) as hub:
        hub.rate = int(size / 3)
        catalog = fetched(source, replicas=0)
        async with cluster(tmp_path, pki, 0, extra_catalog=catalog) as c:
            for node in ("n1", "n2"):
                landing = tmp_path / f"weights-{node}"
                c.agent(
                    node,
                    env=hub_env(tmp_path, hub),
                    more=f'[weights]\ndefault_dir = "{landing}"\n',
                )
                await c.server.wait_node(node, "Ready")
            said = (await c.server.ctl("weights", "prefetch", "fetched")).stdout.decode()
            assert "prefetching fetched's weights" in said and "on n1, n2" in said, said
            # while they fetch, ctl weights says how far each has come
            with trio.fail_after(10):
                while "% of" not in (table := (await c.server.ctl("weights")).stdout.decode()):
                    await trio.sleep(0.2)
            assert f"fetching {source}: " in table, table
            with trio.fail_after(30):
                while True:
                    nodes = json.loads((await c.server.ctl("weights", "--json")).stdout)["nodes"]
                    held = {
                        n["node_id"]
                        for n in nodes
                        for w in n["copies"]
                        if w.get("source") == source
                    }
                    if held == {"n1", "n2"}:
                        break
                    await trio.sleep(0.2)
            table = (await c.server.ctl("weights")).stdout.decode()
            rows = [line for line in table.splitlines() if source in line]
            assert len(rows) == 2 and "tiny" in rows[0], table
            # again: nothing to do, and it says why
            again = (await c.server.ctl("weights", "prefetch", "fetched")).stdout.decode()
            assert "on no node" in again and "not on n1: it holds them already" in again, again
            assert hub.served == 2 * size
            # a model that fetches nothing, or a node that is not there: one line each
            refused = await c.server.ctl("weights", "prefetch", "tiny", check=False)
            assert refused.returncode != 0
            assert b"has no profile with a source" in refused.stderr, refused.stderr
            unknown = await c.server.ctl(
                "weights", "prefetch", "fetched", "--node", "n9", check=False
            )
            assert b"no node n9 is known" in unknown.stderr, unknown.stderr


async def test_two_shards_of_one_file_fetch_it_once_and_a_stop_cancels_the_fetch(
    tmp_path: Path, pki: Pki
) -> None:
    """Through a real agent and the real stream: a second shard that needs the file
    another is fetching follows that fetch (the hub serves it once, both start); a
    shard stopped while its weights come is stopped at once and its fetch cancelled,
    its ``.part`` kept for the next to resume from."""
    root, file = serve_model(tmp_path)
    size = file.stat().st_size
    source = "hf://acme/tiny-GGUF/tiny.gguf"
    landing = tmp_path / "weights"
    target = landing / "hf" / "acme" / "tiny-GGUF" / "main" / "tiny.gguf"
    with HubStandIn(root) as hub:
        hub.rate = int(size / 3)
        async with fleet(tmp_path, pki) as f:
            f.start_agent(
                extra=f'[weights]\ndefault_dir = "{landing}"\n', env=hub_env(tmp_path, hub)
            )

            def spec(shard: str) -> ShardSpec:
                port = PORT_BASE + int(shard[1:])  # each its own: none listens yet
                return msgspec.structs.replace(
                    llama_spec(target, shard, port=port, context=256),
                    weights_source=source,
                    fetch_stall_s=10,
                )

            await f.send("n1", StartShard(spec=spec("s1")))
            await f.status("s1", "starting")
            await f.send("n1", StartShard(spec=spec("s2")))
            one = await f.status("s1", "ready")
            two = await f.status("s2", "ready")
            assert one.pid != two.pid
            assert hub.served == size and len(hub.gets("tiny.gguf")) == 1, hub.requests
            reports = [s for _, s in f.statuses if s.fetching is not None]
            assert {s.shard_id for s in reports} == {"s1", "s2"}, reports

            # another file (another revision), stopped while it comes
            other = "hf://acme/tiny-GGUF@v2/tiny.gguf"
            hub.rate = int(size / 8)  # a 64 KiB write of the stand-in's about every second
            late = msgspec.structs.replace(
                spec("s3"),
                weights_source=other,
                model_path=str(landing / "hf" / "acme" / "tiny-GGUF" / "v2" / "tiny.gguf"),
            )
            await f.send("n1", StartShard(spec=late))
            await wait_for(
                lambda: any(s.shard_id == "s3" and s.fetching for _, s in f.statuses), timeout=10
            )
            await f.send("n1", StopShard(shard_id="s3", grace_s=5))
            stopped = await f.status("s3", "stopped", timeout=5)
            assert not [s for _, s in f.statuses if s.shard_id == "s3" and s.state == "failed"]
            # its fetch is cancelled: the hub sends no more of it (one write it had under
            # way may still go out to a closed connection), and nothing lands
            await trio.sleep(0.5)
            sent = hub.served
            await trio.sleep(3)
            assert hub.served - sent <= CHUNK and hub.served < 2 * size, (sent, hub.served)
            assert not Path(late.model_path).exists()
            assert list(Path(late.model_path).parent.glob("tiny.gguf.*.part"))  # kept
            assert stopped.pid is None  # no engine was launched


async def test_a_disk_budget_evicts_the_longest_unused_never_what_runs(
    tmp_path: Path, pki: Pki
) -> None:
    """[weights] budget_gb holds two of the model's files: a third evicts the one no
    replica uses, never the one that runs; a file that cannot fit beside what runs
    fails in one line, counted, and evicts nothing."""
    root, file = serve_model(tmp_path)
    size = file.stat().st_size
    for repo in ("acme/a-GGUF", "acme/c-GGUF"):
        (root / repo).mkdir(parents=True)
        (root / repo / "tiny.gguf").write_bytes(file.read_bytes())
    (root / "acme" / "d-GGUF").mkdir(parents=True)
    (root / "acme" / "d-GGUF" / "big.gguf").write_bytes(bytes(3 * size))
    hf = "hf://acme/{}-GGUF/{}"
    catalog = (
        model_entry("b", hf.format("tiny", "tiny.gguf"), 1)
        + model_entry("a", hf.format("a", "tiny.gguf"), 0)
        + model_entry("c", hf.format("c", "tiny.gguf"), 0)
        + model_entry("d", hf.format("d", "big.gguf"), 0)
    )
    budget_gb = 2.5 * size / 2**30
    with HubStandIn(root) as hub:
        async with cluster(tmp_path, pki, 0, extra_catalog=catalog) as c:
            landing = tmp_path / "weights"
            c.agent(
                "n1",
                env=hub_env(tmp_path, hub),
                more=f'[weights]\ndefault_dir = "{landing}"\nbudget_gb = {budget_gb}\n'
                '[metrics]\nlisten = "127.0.0.1:0"\n',
            )
            await c.wait_ready(1, model="b")

            async def held() -> set[str]:
                nodes = json.loads((await c.server.ctl("weights", "--json")).stdout)["nodes"]
                return {w["source"] for n in nodes for w in n["copies"] if w.get("source")}

            async def until_held(want: set[str]) -> None:
                with trio.fail_after(20):
                    while await held() != want:
                        await trio.sleep(0.2)

            await c.server.ctl("weights", "prefetch", "a")
            await until_held({hf.format("tiny", "tiny.gguf"), hf.format("a", "tiny.gguf")})
            await c.server.ctl("weights", "prefetch", "c")  # a goes: b runs
            await until_held({hf.format("tiny", "tiny.gguf"), hf.format("c", "tiny.gguf")})
            agent_log = c.agents["n1"].log()
            assert "evict" in agent_log and "a-GGUF" in agent_log, agent_log[-3000:]
            assert (landing / "hf" / "acme" / "tiny-GGUF" / "main" / "tiny.gguf").exists()
            table = (await c.server.ctl("weights")).stdout.decode()
            assert "budget" in table and "ago" in table, table

            # three times the file beside the one that runs: no room, said once
            await c.server.ctl("weights", "prefetch", "d")
            line = await c.agents["n1"].wait_log(r"cannot fetch hf://acme/d-GGUF/big.gguf: (.*)")
            assert "budget" in line.group(1) and "budget_gb" in line.group(1), line.group(0)
            assert await held() == {hf.format("tiny", "tiny.gguf"), hf.format("c", "tiny.gguf")}
            text = await agent_metrics(c, "n1")
            assert 'llmgw_agent_weights_fetch_failures_total{reason="no_room"} 1.0' in text


async def prefetched(c: Cluster, model: str, nodes: set[str]) -> str:
    """``ctl weights prefetch MODEL`` once every node's transfer listener is known,
    and what it said, once ``nodes`` all hold the model's weights."""
    with trio.fail_after(10):
        while not all(n["weights_port"] for n in (await c.server.nodes()).values()):
            await trio.sleep(0.1)
    said = (await c.server.ctl("weights", "prefetch", model)).stdout.decode()
    with trio.fail_after(30):
        while True:
            listed = json.loads((await c.server.ctl("weights", "--json")).stdout)["nodes"]
            held = {n["node_id"] for n in listed for w in n["copies"] if w["source"]}
            if held == nodes:
                return said
            await trio.sleep(0.2)


async def test_nodes_of_a_fabric_take_weights_from_each_other_and_read_the_hub_once(
    tmp_path: Path, pki: Pki
) -> None:
    """Three agents with transfer listeners, prefetched together: the first fetches
    from the hub, the second takes from the first and the third from the second, each
    chunk as soon as it is checked; the hub serves the file once, and the bytes are
    counted as from a peer."""
    root, file = serve_model(tmp_path)
    size = file.stat().st_size
    source = "hf://acme/tiny-GGUF/tiny.gguf"
    with HubStandIn(root) as hub:
        hub.rate = int(size / 3)
        catalog = fetched(source, replicas=0)
        async with cluster(tmp_path, pki, 0, extra_catalog=catalog) as c:
            for node in ("n1", "n2", "n3"):
                landing = tmp_path / f"weights-{node}"
                c.agent(
                    node,
                    env=hub_env(tmp_path, hub),
                    more=f'[weights]\ndefault_dir = "{landing}"\npeer_listen = "127.0.0.1:0"\n'
                    '[metrics]\nlisten = "127.0.0.1:0"\n',
                )
                await c.server.wait_node(node, "Ready")
            said = await prefetched(c, "fetched", {"n1", "n2", "n3"})
            assert "on n1, n2, n3" in said, said
            assert hub.served == size, (hub.served, size)  # the hub read once
            for node in ("n2", "n3"):
                text = await agent_metrics(c, node)
                line = f'llmgw_agent_weights_fetched_bytes_total{{source="peer"}} {size:.1f}'
                assert line in text, (node, text)
                assert 'source="hub"' not in text, text
            landed = [
                tmp_path / f"weights-{n}" / "hf" / "acme" / "tiny-GGUF" / "main" / "tiny.gguf"
                for n in ("n1", "n2", "n3")
            ]
            assert all(p.read_bytes() == file.read_bytes() for p in landed)


async def test_a_node_without_room_for_the_weights_fails_the_fetch_and_the_replica_goes_elsewhere(
    tmp_path: Path, pki: Pki
) -> None:
    root, file = serve_model(tmp_path)
    size = file.stat().st_size
    source = "hf://acme/tiny-GGUF/tiny.gguf"
    with HubStandIn(root) as hub:
        catalog = model_entry("roomy", source, 1)
        async with cluster(tmp_path, pki, 0, extra_catalog=catalog) as c:
            budget_gb = size / 2 / 2**30  # half the file
            c.agent(
                "n1",
                env=hub_env(tmp_path, hub),
                more=f'[weights]\ndefault_dir = "{tmp_path / "w1"}"\nbudget_gb = {budget_gb}\n',
            )
            await c.server.wait_node("n1", "Ready")
            line = await c.agents["n1"].wait_log(
                r"cannot fetch hf://acme/tiny-GGUF/tiny.gguf: (.*)"
            )
            assert "no room" in line.group(1) and "budget_gb" in line.group(1), line.group(0)
            c.agent(
                "n2",
                env=hub_env(tmp_path, hub),
                more=f'[weights]\ndefault_dir = "{tmp_path / "w2"}"\n',
            )
            (ready,) = await c.wait_ready(1, timeout=60, model="roomy")
            assert ready["shards"][0]["node_id"] == "n2", ready
            models = json.loads((await c.server.ctl("models", "--json")).stdout)["models"]
            (view,) = [m for m in models if m["model"] == "roomy"]
            assert any("no room" in f["reason"] for f in view["failures"]), view["failures"]
            explained = (await c.server.ctl("explain-placement", "roomy")).stdout.decode()
            assert "no room on its disk for the weights" in explained, explained


FOLDER = """
[models.folder]
replicas = {replicas}
[[models.folder.profiles]]
name = "gpu"
engine = "vllm"
gpus = 1
min_memory_gb = 1
source = "hf://acme/tiny-vllm"
env = {{ STANDIN_LOAD_S = "0.5" }}
startup_timeout_s = 30
"""


async def test_a_vllm_replica_of_a_whole_repository_fetches_its_folder_and_serves(
    tmp_path: Path, pki: Pki
) -> None:
    """hf://ORG/REPO: the agent lists the repository, fetches every file into one
    folder (config.json last), and starts vLLM (the suite's stand-in) on the folder."""
    root = tmp_path / "hub"
    files = write_repo(root)
    bindir = tmp_path / "bin"
    wrapper(bindir, "vllm")
    catalog = FOLDER.format(replicas=1)
    with HubStandIn(root) as hub:
        async with cluster(tmp_path, pki, 0, extra_catalog=catalog) as c:
            landing = tmp_path / "w"
            env = {**hub_env(tmp_path, hub), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
            c.agent("n1", env=env, more=f'[weights]\ndefault_dir = "{landing}"\n')
            (ready,) = await c.wait_ready(1, timeout=60, model="folder")
            folder = landing / "hf" / "acme" / "tiny-vllm" / "main"
            for name, data in files.items():
                assert (folder / name).read_bytes() == data, name
            agent_log = c.agents["n1"].log()
            assert str(folder) in agent_log, agent_log[-2000:]  # the engine was given it
            n1 = (await c.server.nodes())["n1"]
            assert any(w.get("source") == "hf://acme/tiny-vllm" for w in n1["weights"]), n1
            assert ready["shards"][0]["node_id"] == "n1"


async def test_a_repository_is_taken_from_a_peer_file_by_file_and_the_hub_read_once(
    tmp_path: Path, pki: Pki
) -> None:
    root = tmp_path / "hub"
    files = write_repo(root)
    bindir = tmp_path / "bin"
    wrapper(bindir, "vllm")
    with HubStandIn(root) as hub:
        hub.rate = 2 << 20  # the big file takes a second and a half: the second node follows
        async with cluster(tmp_path, pki, 0, extra_catalog=FOLDER.format(replicas=0)) as c:
            env = {**hub_env(tmp_path, hub), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
            for node in ("n1", "n2"):
                c.agent(
                    node,
                    env=env,
                    more=f'[weights]\ndefault_dir = "{tmp_path / ("w" + node)}"\n'
                    'peer_listen = "127.0.0.1:0"\n',
                )
                await c.server.wait_node(node, "Ready")
            said = await prefetched(c, "folder", {"n1", "n2"})
            assert "on n1, n2" in said, said
            for name, data in files.items():
                sent = sum(r.sent for r in hub.gets(f"/resolve/main/{name}"))
                assert sent == len(data), (name, sent, len(data))  # once, to n1
                folder = tmp_path / "wn2" / "hf" / "acme" / "tiny-vllm" / "main"
                assert (folder / name).read_bytes() == data, name
            assert "took hf://acme/tiny-vllm/model-00001" in c.agents["n2"].log()
