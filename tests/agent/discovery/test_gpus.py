"""GPU discovery: the parser on the real H200 output, discovery against a stand-in nvidia-smi.

The stand-in (``fake_nvidia_smi.py``) answers from the same real fixture; a
small wrapper written into tmp_path as ``nvidia-smi`` execs it with this
interpreter, so the process trio starts is the one that is checked for.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery.gpus import (
    ESSENTIAL_FIELDS,
    QUERY_FIELDS,
    GpuDiscovery,
    GpuParseError,
    discover_gpus,
    health_problems,
    parse_gpu_csv,
)
from llmgw.protocol.messages import Gpu

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-h200"
FAKE = Path(__file__).resolve().with_name("fake_nvidia_smi.py")
UUID = "GPU-a28b07a0-4e77-4642-1c8d-52004e98b9e4"
DEADLINE = 15  # s, for each test that runs processes

IDLE_H200 = Gpu(
    index=0,
    uuid=UUID,
    name="NVIDIA H200",
    pci_bus_id="00000000:00:06.0",
    memory_total_mib=143771,
    memory_used_mib=0,
    memory_free_mib=143156,
    utilization_pct=0,
    temperature_c=32,
    driver_version="580.159.04",
    compute_capability="9.0",
    healthy=True,
    problems=[],
)


def fixture_query(*, must_have: str) -> tuple[list[str], str]:
    """(fields, output) of the noheader,nounits --query-gpu block in discovery.txt asking for a field."""
    text = (FIXTURES / "discovery.txt").read_text()
    block = re.compile(r"^### \$ (nvidia-smi [^\n]*)\n(.*?)^### rc=0$", re.M | re.S)
    for m in block.finditer(text):
        command, output = m.group(1), m.group(2)
        q = re.search(r"--query-gpu=(\S+) --format=csv,noheader,nounits$", command)
        if q and must_have in q.group(1).split(","):
            return q.group(1).split(","), output
    raise AssertionError(f"no noheader,nounits query for {must_have} in discovery.txt")


# --- the parser, on the real output ------------------------------------------------


def test_parses_the_real_identity_line() -> None:
    fields, output = fixture_query(must_have="driver_version")
    assert parse_gpu_csv(output, fields) == [
        Gpu(
            index=0,
            uuid=UUID,
            name="NVIDIA H200",
            pci_bus_id="00000000:00:06.0",
            memory_total_mib=143771,
            memory_used_mib=0,
            memory_free_mib=143156,
            utilization_pct=0,
            temperature_c=32,
            driver_version="580.159.04",
        )
    ]


def test_parses_the_real_health_line() -> None:
    """[N/A] retired pages and No/No remapped rows: a healthy GPU, compute capability 9.0."""
    fields, output = fixture_query(must_have="remapped_rows.failure")
    assert "[N/A]" in output  # retired_pages.pending on an H200
    [gpu] = parse_gpu_csv(output, fields)
    assert gpu.index == 0
    assert gpu.compute_capability == "9.0"
    assert gpu.healthy is True
    assert gpu.problems == []
    # fields that this line does not carry are unknown, not zero
    assert gpu.memory_total_mib is None
    assert gpu.temperature_c is None
    assert gpu.uuid == ""


def test_parses_by_name_not_position() -> None:
    fields, output = fixture_query(must_have="driver_version")
    order = [8, 2, 0, 9, 5, 1, 3, 7, 4, 6]
    cells = output.strip().split(", ")
    shuffled = ", ".join(cells[i] for i in order)
    assert parse_gpu_csv(shuffled, [fields[i] for i in order]) == parse_gpu_csv(output, fields)


def test_busy_gpu_memory_used() -> None:
    """busy.txt's line: a process held 20 GiB (fields as the stand-in reads them)."""
    first = (FIXTURES / "busy.txt").read_text().splitlines()[0]
    fields = ["index", "uuid", "memory.total", "memory.used", "memory.free", "utilization.gpu"]
    [gpu] = parse_gpu_csv(first, fields)
    assert gpu.memory_used_mib == 21007
    assert gpu.memory_free_mib == 122150
    assert gpu.memory_total_mib == 143771


def test_unknown_values_are_none_not_zero() -> None:
    fields = ["index", "memory.total", "memory.used", "temperature.gpu", "utilization.gpu", "name"]
    [gpu] = parse_gpu_csv("3, [N/A], [Not Supported], N/A, , [Unknown Error]\n", fields)
    assert gpu.index == 3
    assert gpu.memory_total_mib is None
    assert gpu.memory_used_mib is None
    assert gpu.temperature_c is None
    assert gpu.utilization_pct is None
    assert gpu.name == ""


def test_the_header_and_units_form_is_refused_not_misread() -> None:
    """The fixture's --format=csv output (header, units) is not what discovery asks for."""
    text = (FIXTURES / "discovery.txt").read_text()
    m = re.search(r"--format=csv\n(index, uuid.*?\n.*?\n)### rc=0", text, re.S)
    assert m is not None
    fields, _ = fixture_query(must_have="driver_version")
    with pytest.raises(GpuParseError, match=r"^line 1: index is 'index', not a whole number$"):
        parse_gpu_csv(m.group(1), fields)
    with pytest.raises(GpuParseError, match=r"line 1: memory.total is '143771 MiB', not a whole"):
        parse_gpu_csv(m.group(1).splitlines()[1], fields)


def test_a_gpu_without_a_known_index_is_refused() -> None:
    with pytest.raises(GpuParseError, match=r"^line 1: the GPU's index is unknown \('\[N/A\]'\)$"):
        parse_gpu_csv(f"[N/A], {UUID}\n", ["index", "uuid"])
    with pytest.raises(GpuParseError, match=r"^line 1: the GPU's index is unknown \(''\)$"):
        parse_gpu_csv(f"{UUID}\n", ["uuid"])


def test_wrong_number_of_fields_says_so() -> None:
    with pytest.raises(GpuParseError, match=r"^line 2 has 3 fields, expected 15$"):
        parse_gpu_csv("\n, ,\n", QUERY_FIELDS)
    with pytest.raises(GpuParseError, match=r"^line 1 has 3 fields, expected 2$"):
        parse_gpu_csv("0, GPU-x, NVIDIA H200\n", ["index", "uuid"])


def test_numbers_are_plain_ascii_digits() -> None:
    """Not '1_000', not Arabic-Indic digits, not 5000 digits (int() would raise ValueError)."""
    for odd in ("1_000", "\u0663", "+5", "9" * 5000):
        with pytest.raises(GpuParseError, match=r"memory\.total is .* not a whole number"):
            parse_gpu_csv(f"0, {odd}\n", ["index", "memory.total"])


def test_empty_output_is_no_gpus() -> None:
    assert parse_gpu_csv("", QUERY_FIELDS) == []
    assert parse_gpu_csv("\n\n", QUERY_FIELDS) == []


# --- health ----------------------------------------------------------------------


def test_health_problems_in_words() -> None:
    assert health_problems(
        {
            "ecc.errors.uncorrected.volatile.total": "3",
            "retired_pages.pending": "Yes",
            "remapped_rows.failure": "Yes",
            "remapped_rows.pending": "Yes",
        }
    ) == [
        "3 uncorrected ECC errors",
        "pending retired pages",
        "remapped-row failure",
        "remapped rows pending a GPU reset",
    ]
    assert health_problems({"ecc.errors.uncorrected.volatile.total": "1"}) == [
        "1 uncorrected ECC error"
    ]


def test_health_of_the_real_h200_is_fine() -> None:
    fields, output = fixture_query(must_have="remapped_rows.failure")
    values = dict(zip(fields, output.strip().split(", "), strict=True))
    assert values["retired_pages.pending"] == "[N/A]"
    assert health_problems(values) == []
    assert health_problems({}) == []


def test_unexpected_health_values_are_problems() -> None:
    problems = health_problems(
        {"ecc.errors.uncorrected.volatile.total": "lots", "remapped_rows.failure": "Maybe"}
    )
    assert problems == [
        "uncorrected ECC error count is unreadable ('lots')",
        "remapped_rows.failure is neither Yes nor No ('Maybe')",
    ]


# --- hypothesis --------------------------------------------------------------------

_REAL_CELLS = ["0", UUID, "NVIDIA H200", "143771", "[N/A]", "No", "Yes", "9.0", "", "-1"]
_cell = st.one_of(
    st.sampled_from(_REAL_CELLS),
    st.text(st.characters(blacklist_characters=",\n\r"), max_size=12),
    st.integers().map(str),
)
_fields = st.lists(st.sampled_from(QUERY_FIELDS), min_size=1, max_size=15, unique=True)


def parse_or_error(text: str, fields: list[str]) -> list[Gpu] | str:
    """The GPUs, or a GpuParseError's message; any other exception propagates."""
    try:
        return parse_gpu_csv(text, fields)
    except GpuParseError as e:
        return str(e)


_csvish = st.text(st.sampled_from(list(", \n\r\t[]N/AYesNo0123456789-.GPU")), max_size=80)


@given(st.one_of(st.text(), _csvish), _fields)
def test_arbitrary_text_raises_only_parse_errors(text: str, fields: list[str]) -> None:
    result = parse_or_error(text, fields)  # anything else raised fails the test
    if isinstance(result, str):
        assert result
    else:
        assert all(isinstance(g, Gpu) for g in result)


@given(
    _fields.flatmap(
        lambda f: st.tuples(
            st.just(f), st.lists(st.lists(_cell, min_size=len(f), max_size=len(f)), max_size=4)
        )
    )
)
def test_well_shaped_rows_of_odd_cells_raise_only_parse_errors(
    case: tuple[list[str], list[list[str]]],
) -> None:
    fields, rows = case
    text = "".join(", ".join(r) + "\n" for r in rows)
    result = parse_or_error(text, fields)
    if isinstance(result, str):
        assert result.startswith("line ")
    else:
        assert len(result) == sum(1 for r in rows if ", ".join(r).strip())
        for g in result:
            assert g.healthy == (not g.problems)


# --- discovery against the stand-in ----------------------------------------------------


@pytest.fixture
def nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable ``nvidia-smi`` in its own directory, first on the PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "nvidia-smi"
    # The shell notes its pid (the stand-in's too, after exec) before python starts,
    # so even a stand-in killed while starting up can be checked for.
    exe.write_text(
        "#!/bin/sh\n"
        'if [ -n "$FAKE_NVIDIA_SMI_PIDFILE" ]; then echo $$ > "$FAKE_NVIDIA_SMI_PIDFILE"; fi\n'
        f'exec "{sys.executable}" "{FAKE}" "$@"\n'
    )
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    for name in ("FAKE_NVIDIA_SMI_MODE", "FAKE_NVIDIA_SMI_GPUS", "FAKE_NVIDIA_SMI_PIDFILE"):
        monkeypatch.delenv(name, raising=False)
    return exe


async def test_finds_the_h200_in_one_call(nvidia_smi: Path) -> None:
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    assert found == GpuDiscovery(gpus=[IDLE_H200], present=True)


async def test_busy_gpu(nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "busy")
    with trio.fail_after(DEADLINE):
        found = await discover_gpus(str(nvidia_smi))
    assert found.error == ""
    [gpu] = found.gpus
    assert gpu.memory_used_mib == 21007
    assert gpu.memory_free_mib == 122150


async def test_absent_nvidia_smi_is_a_node_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with trio.fail_after(DEADLINE):
        on_path = await discover_gpus()
        by_path = await discover_gpus(str(tmp_path / "no" / "nvidia-smi"))
    assert on_path == GpuDiscovery(gpus=[], present=False, error="")
    assert by_path == GpuDiscovery(gpus=[], present=False, error="")


async def test_failing_nvidia_smi_says_why(
    nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "fail")
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    assert found.gpus == []
    assert found.present is True
    assert found.error == (
        "nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate with"
        " the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
    )


async def test_hanging_nvidia_smi_is_killed_at_the_timeout(
    nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "hang")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_PIDFILE", str(pidfile))
    started = time.monotonic()
    with trio.fail_after(DEADLINE):
        found = await discover_gpus(timeout=1.0)
    took = time.monotonic() - started
    assert found == GpuDiscovery(gpus=[], present=True, error="nvidia-smi timed out after 1 s")
    assert took < 2.5, f"took {took:.1f} s"  # the stand-in ignores SIGTERM: SIGKILL at once
    pid = int(pidfile.read_text())  # it did start, and hang
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped


async def test_garbage_is_a_failed_discovery(
    nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "garbage")
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    assert found.gpus == []
    assert found.present is True
    assert found.error == (
        "nvidia-smi printed output that is not the expected CSV: line 1 has 3 fields, expected 15"
    )


async def test_unknown_field_is_dropped_and_asked_again(
    nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "unknown-field:remapped_rows.failure,compute_cap")
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    assert found.error == ""
    assert found.dropped_fields == ("compute_cap", "remapped_rows.failure")
    [gpu] = found.gpus
    assert gpu.uuid == UUID
    assert gpu.memory_total_mib == 143771
    assert gpu.compute_capability == ""  # unknown, since it could not be asked
    assert gpu.healthy is True


@pytest.mark.parametrize("field", ESSENTIAL_FIELDS)
async def test_an_unknown_essential_field_is_a_failure(
    nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", f"unknown-field:{field}")
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    assert found.gpus == []
    assert found.error == f"nvidia-smi does not know the essential field {field!r}"


async def test_retries_are_bounded(nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every optional field unknown: one call each, then the essential ones alone succeed."""
    optional = [f for f in QUERY_FIELDS if f not in ESSENTIAL_FIELDS]
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "unknown-field:" + ",".join(optional))
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    assert found.error == ""
    assert found.dropped_fields == tuple(optional)
    assert [(g.index, g.uuid, g.name, g.memory_total_mib) for g in found.gpus] == [
        (0, UUID, "NVIDIA H200", 143771)
    ]


async def test_unhealthy_gpu_says_why(nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "unhealthy")
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    [gpu] = found.gpus
    assert gpu.healthy is False
    assert gpu.problems == [
        "2 uncorrected ECC errors",
        "remapped-row failure",
        "remapped rows pending a GPU reset",
    ]


async def test_several_gpus_one_unhealthy(
    nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_GPUS", "4")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "unhealthy:2")
    with trio.fail_after(DEADLINE):
        found = await discover_gpus()
    assert found.error == ""
    assert [g.index for g in found.gpus] == [0, 1, 2, 3]
    assert [g.pci_bus_id for g in found.gpus] == [
        "00000000:00:06.0",
        "00000000:00:07.0",
        "00000000:00:08.0",
        "00000000:00:09.0",
    ]
    assert len({g.uuid for g in found.gpus}) == 4
    assert found.gpus[0] == IDLE_H200
    assert [g.healthy for g in found.gpus] == [True, True, False, True]
