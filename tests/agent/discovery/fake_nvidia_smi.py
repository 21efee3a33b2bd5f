#!/usr/bin/env python3
"""A stand-in for ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``.

Every value it prints comes from real output of an H200 node, read at run
time from ``tests/fixtures/nvidia-h200/``: each ``--query-gpu`` command in
``discovery.txt`` that used ``--format=csv,noheader,nounits`` is zipped field
by field with its output line into a field -> value table. It knows exactly
the fields that the fixture shows; any other field is refused the way the
fixture shows the real one refusing ``bogus.field``:
``Field "x" is not a valid field to query.``, a blank line, exit status 2.
(The fixture merges stdout and stderr; this prints on stdout.)

Only stdlib, so any python3 runs it. Modes, from FAKE_NVIDIA_SMI_MODE:

- ``ok`` (default): the idle GPU from discovery.txt.
- ``busy``: the same, with the values of busy.txt's CSV line (a process held
  20 GiB). That line was captured without its command; its six values are
  read as index, uuid, memory.total, memory.used, memory.free,
  utilization.gpu (uuid and memory.total match discovery.txt, and
  total - used - free = 614 MiB matches the 616 MiB "reserved" of
  nvidia-smi-q.xml as closely as the idle line's 615 does).
- ``unknown-field:a,b``: as ``ok``, but also refuses fields a and b, as a
  driver too old to know them would.
- ``unhealthy`` or ``unhealthy:<index>``: DERIVED, not captured: the real row
  with only health fields changed, uncorrected volatile ECC errors 0 -> 2,
  remapped_rows.pending No -> Yes, remapped_rows.failure No -> Yes
  (retired_pages.pending stays [N/A]: an H200 has no page retirement). All
  GPUs, or only the one with that index.
- ``fail``: NOT from the fixture: the message and exit status 9 that
  nvidia-smi gives when it cannot reach the driver (NVML's "driver not
  loaded").
- ``hang``: writes its pid to FAKE_NVIDIA_SMI_PIDFILE (if set), ignores
  SIGTERM (a wedged nvidia-smi may not honour it), and sleeps forever.
- ``garbage``: exit 0 with output that is not the CSV asked for.

``--query-compute-apps=pid,process_name,used_memory,gpu_uuid`` (any subset):
as captured, nothing in the idle modes, and busy.txt's row (python3 holding
20998 MiB) in ``busy``; FAKE_NVIDIA_SMI_APP_PID replaces its pid (DERIVED:
so a test can point it at a process of its own).

FAKE_NVIDIA_SMI_GPUS=<n> (default 1): DERIVED for multi-GPU tests: the real
row repeated n times: GPU 0 as captured, GPU i > 0 with index i, the uuid's
last 4 hex digits replaced by i in hex, and PCI bus id device 0x06 + i.
Everything else as captured.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-h200"
QUERY_FORMAT = "csv,noheader,nounits"

# Changed health fields for the "unhealthy" mode (see the module docstring).
UNHEALTHY = {
    "ecc.errors.uncorrected.volatile.total": "2",
    "remapped_rows.pending": "Yes",
    "remapped_rows.failure": "Yes",
}
# Field names of busy.txt's first line, which was captured without its command.
BUSY_FIELDS = (
    "index",
    "uuid",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
)
FAIL_MESSAGE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
FAIL_EXIT = 9


def fixture_table() -> dict[str, str]:
    """field -> value from every noheader,nounits --query-gpu block of discovery.txt."""
    text = (FIXTURES / "discovery.txt").read_text()
    table: dict[str, str] = {}
    block = re.compile(r"^### \$ (nvidia-smi [^\n]*)\n(.*?)^### rc=(\d+)$", re.M | re.S)
    for m in block.finditer(text):
        command, output, rc = m.group(1), m.group(2), m.group(3)
        q = re.search(r"--query-gpu=(\S+)", command)
        if not q or f"--format={QUERY_FORMAT}" not in command.split() or rc != "0":
            continue
        fields = q.group(1).split(",")
        values = output.strip("\n").split(", ")
        assert len(fields) == len(values), (command, output)
        for field, value in zip(fields, values, strict=True):
            assert table.get(field, value) == value, (field, table[field], value)
            table[field] = value
    return table


def busy_values() -> dict[str, str]:
    first = (FIXTURES / "busy.txt").read_text().splitlines()[0]
    values = first.split(", ")
    assert len(values) == len(BUSY_FIELDS), first
    return dict(zip(BUSY_FIELDS, values, strict=True))


APP_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")


def compute_apps(fields: list[str], mode_name: str) -> int:
    """The busy.txt second line, as ``--query-compute-apps`` printed it."""
    unknown = [f for f in fields if f not in APP_FIELDS]
    if unknown:
        sys.stdout.write(f'Field "{unknown[0]}" is not a valid field to query.\n\n')
        return 2
    if mode_name != "busy":
        return 0
    lines = [ln for ln in (FIXTURES / "busy.txt").read_text().splitlines() if ln.strip()]
    row = dict(zip(APP_FIELDS, lines[1].split(", "), strict=True))
    row["pid"] = os.environ.get("FAKE_NVIDIA_SMI_APP_PID", row["pid"])
    sys.stdout.write(", ".join(row[f] for f in fields) + "\n")
    return 0


def arguments(argv: list[str]) -> tuple[list[str], str]:
    fields: list[str] | None = None
    fmt = ""
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--query-gpu", "--query-compute-apps", "--format") and not eq:
            i += 1
            value = argv[i] if i < len(argv) else ""
        if name == "--query-gpu":
            fields = value.split(",")
        elif name == "--query-compute-apps":
            fields = ["compute-apps", *value.split(",")]
        elif name == "--format":
            fmt = value
        else:
            sys.exit(f"fake_nvidia_smi: {arg!r} is not mimicked")
        i += 1
    if fields is None:
        sys.exit("fake_nvidia_smi: only --query-gpu is mimicked")
    return fields, fmt


def main() -> int:
    fields, fmt = arguments(sys.argv[1:])
    mode = os.environ.get("FAKE_NVIDIA_SMI_MODE", "ok")
    mode_name, _, mode_arg = mode.partition(":")
    if fields and fields[0] == "compute-apps":
        return compute_apps(fields[1:], mode_name)
    count = int(os.environ.get("FAKE_NVIDIA_SMI_GPUS", "1"))

    if mode_name == "hang":
        pidfile = os.environ.get("FAKE_NVIDIA_SMI_PIDFILE")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if pidfile:
            Path(pidfile).write_text(str(os.getpid()))
        while True:
            time.sleep(3600)
    if mode_name == "fail":
        sys.stdout.write(FAIL_MESSAGE)
        return FAIL_EXIT
    if mode_name == "garbage":
        sys.stdout.write("\x1b[31mSegmentation, fault, (core dumped)\x1b[0m\n\x00\x01\x02\n")
        return 0

    table = fixture_table()
    known = set(table)
    if mode_name == "unknown-field":
        known -= set(mode_arg.split(","))
    for field in fields:
        if field not in known:
            # As the fixture shows for bogus.field: the message, a blank line, rc=2.
            sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
            return 2
    if fmt != QUERY_FORMAT:
        sys.exit(f"fake_nvidia_smi: only --format={QUERY_FORMAT} is mimicked, not {fmt!r}")

    if mode_name == "busy":
        table.update(busy_values())
    lines = []
    for i in range(count):
        row = dict(table)
        if i > 0:
            row["index"] = str(i)
            row["uuid"] = row["uuid"][:-4] + f"{i:04x}"
            bus, _, function = row["pci.bus_id"].rpartition(".")
            domain_bus, _, device = bus.rpartition(":")
            row["pci.bus_id"] = f"{domain_bus}:{int(device, 16) + i:02X}.{function}"
        if mode_name == "unhealthy" and (not mode_arg or mode_arg == row["index"]):
            row.update(UNHEALTHY)
        lines.append(", ".join(row[f] for f in fields))
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
