"""InfiniBand from a /sys tree, engines from executables on PATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from llmgw.agent.discovery.engines import find_llama_server, probe_engines
from llmgw.agent.discovery.infiniband import read_adapters
from llmgw.engines.llamacpp import parse_version
from llmgw.protocol.messages import Engine, IbAdapter, IbPort


def make_port(root: Path, adapter: str, port: int, state: str, rate: str) -> None:
    d = root / adapter / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "rate").write_text(rate + "\n")


def test_adapters_ports_and_fabric_labels_from_config(tmp_path: Path) -> None:
    make_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    make_port(tmp_path, "mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)")
    adapters = read_adapters(tmp_path, {"mlx5_0": "ib-a"})
    assert adapters == [
        IbAdapter(
            name="mlx5_0",
            ports=[IbPort(port=1, state="ACTIVE", rate="200 Gb/sec (4X HDR)")],
            fabric="ib-a",
        ),
        IbAdapter(name="mlx5_1", ports=[IbPort(port=1, state="DOWN", rate="10 Gb/sec (4X SDR)")]),
    ]


def test_no_adapters_is_not_an_error(tmp_path: Path) -> None:
    # the H200 fixture: /sys/class/infiniband exists and is empty
    assert read_adapters(tmp_path) == []
    assert read_adapters(tmp_path / "missing") == []


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return d


def test_llama_version_text() -> None:
    assert parse_version("version: 11434 (5d3b1f2)\nbuilt with cc for x86_64") == "b11434"
    assert parse_version("version: 0.6.0-dev (build 11434, commit unknown)") == "b11434"
    assert parse_version("garbage") == ""


async def test_engines_found_on_path_with_versions(
    bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executable(
        bin_dir / "llama-server",
        "#!/bin/sh\necho 'version: 11434 (5d3b1f2)' >&2\necho 'built with cc' >&2\n",
    )
    # vllm and ray are console scripts; their versions come from package metadata
    site = tmp_path / "site"
    for name, version in (("vllm", "0.11.2"), ("ray", "2.51.1")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        executable(bin_dir / name, f"#!{sys.executable}\nraise SystemExit('too slow to ask')\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    with trio.fail_after(30):
        engines = await probe_engines(python_package=False)
    assert engines == [
        Engine(name="llama.cpp", version="b11434", path=str(bin_dir / "llama-server")),
        Engine(name="vllm", version="0.11.2", path=str(bin_dir / "vllm")),
        Engine(name="ray", version="2.51.1", path=str(bin_dir / "ray")),
    ]


async def test_llama_server_found_where_archives_are_unpacked(
    bin_dir: Path, tmp_path: Path
) -> None:
    unpacked = tmp_path / "opt" / "llama-b11434-bin-ubuntu-x64" / "build" / "bin"
    unpacked.mkdir(parents=True)
    server = executable(unpacked / "llama-server", "#!/bin/sh\necho 'version: 11434 (abc)' >&2\n")
    pattern = str(tmp_path / "opt" / "llama-*" / "build" / "bin" / "llama-server")
    assert find_llama_server([pattern]) == str(server)
    with trio.fail_after(30):
        engines = await probe_engines(search={"llama-server": [pattern]})
    assert engines == [Engine(name="llama.cpp", version="b11434", path=str(server))]


async def test_a_hanging_or_failing_probe_leaves_the_engine_without_a_version(
    bin_dir: Path,
) -> None:
    executable(bin_dir / "llama-server", "#!/bin/sh\nsleep 30\n")
    with trio.fail_after(10):
        engines = await probe_engines(probe_timeout=0.3, python_package=False)
    assert engines == [Engine(name="llama.cpp", version="", path=str(bin_dir / "llama-server"))]


async def test_nothing_installed_means_no_engines(bin_dir: Path) -> None:
    with trio.fail_after(10):
        found = await probe_engines(
            search={"llama-server": ["/nonexistent/*/llama-server"]}, python_package=False
        )
        assert found == []
