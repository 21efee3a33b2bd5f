"""The inventory the agent sends: discovery, with what is written winning."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from llmgw.agent.discovery.address import route_address
from llmgw.agent.discovery.memory import parse_meminfo
from llmgw.agent.inventory import InventorySource, same_inventory
from llmgw.config.schema import DiscoveryConfig, GpuOverride, InventoryOverrides, WeightsConfig
from llmgw.protocol.messages import Engine, Gpu, Inventory, Memory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-h200"


def test_meminfo_from_the_real_node() -> None:
    mem = parse_meminfo((FIXTURES / "meminfo.txt").read_text())
    assert mem == Memory(total_bytes=131981020 * 1024, available_bytes=131462972 * 1024)
    assert parse_meminfo("MemFree: 12 kB\n") == Memory()  # unknown stays unknown


def test_route_address_picks_the_local_end_of_the_route() -> None:
    assert route_address("127.0.0.1", 7443) == "127.0.0.1"
    if socket.has_ipv6:
        assert route_address("::1", 7443) in ("::1", "")
    assert route_address("no-such-host.invalid", 7443) == ""


def source(tmp_path: Path, overrides: InventoryOverrides) -> InventorySource:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text((FIXTURES / "meminfo.txt").read_text())
    return InventorySource(
        overrides,
        ("127.0.0.1", 7443),
        discovery=DiscoveryConfig(
            nvidia_smi="/nonexistent", meminfo=str(meminfo), infiniband=str(tmp_path / "ib")
        ),
        weights=WeightsConfig(default_dir=str(tmp_path / "nothing")),
    )


async def test_discovered_then_overridden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no engines, no nvidia-smi
    plain = source(tmp_path, InventoryOverrides())
    with trio.fail_after(10):
        await plain.refresh()
    inv = plain.inventory()
    assert inv.memory.total_bytes == 131981020 * 1024
    assert inv.address == "127.0.0.1"
    assert inv.gpus == []
    assert inv.weights_scanned is False  # told nothing: reports nothing

    written = source(
        tmp_path,
        InventoryOverrides(
            address="10.9.9.9",
            cpus=96,
            memory_gb=512,
            fabric="ib-a",
            labels={"role": "coding"},
            gpus=[GpuOverride(index=0, name="NVIDIA H100", memory_total_mib=81559)],
            engines={"vllm": "0.11.2"},
        ),
    )
    with trio.fail_after(10):
        await written.refresh()
    inv = written.inventory()
    assert (inv.address, inv.cpus, inv.fabric, inv.labels) == (
        "10.9.9.9",
        96,
        "ib-a",
        {"role": "coding"},
    )
    assert inv.memory.total_bytes == 512 * 2**30
    assert inv.gpus == [Gpu(index=0, name="NVIDIA H100", memory_total_mib=81559)]
    assert [e for e in inv.engines if e.name == "vllm"] == [Engine(name="vllm", version="0.11.2")]


def test_gpu_telemetry_and_memory_readings_are_not_inventory_changes() -> None:
    a = Inventory(
        gpus=[Gpu(index=0, memory_used_mib=0, temperature_c=32)], memory=Memory(total_bytes=1)
    )
    b = Inventory(
        gpus=[Gpu(index=0, memory_used_mib=21007, temperature_c=33)], memory=Memory(total_bytes=2)
    )
    assert same_inventory(a, b)
    c = Inventory(gpus=[Gpu(index=0, healthy=False, problems=["remapped-row failure"])])
    assert not same_inventory(a, c)
