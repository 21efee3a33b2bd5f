"""NVIDIA GPUs, from one ``nvidia-smi --query-gpu`` call.

Choices, and why:

- **One query.** Every field, identity and health alike, is asked for in a
  single ``--query-gpu=... --format=csv,noheader,nounits`` call: one process,
  one pass over NVML, so discovery stays cheap on a busy node.
- **By field name, not position.** Each CSV line is zipped with the list of
  fields that was actually asked for and read as a name → value mapping, so
  the field list can change (or shrink, below) without touching the parser.
  ``[N/A]``, ``[Not Supported]``, ``N/A`` and blanks are unknown: ``None``,
  never ``0``.
- **An unknown field is dropped, not fatal.** An older driver answers a field
  it does not know with ``Field "x" is not a valid field to query.`` and exit
  status 2, printing no GPUs at all. The field is named in that message, so
  discovery drops it and asks again, at most once per optional field. The
  essential fields (index, uuid, name, memory.total) are never dropped: a
  driver that does not know those is a failure, reported as such.
- **Absent is not an error.** No ``nvidia-smi`` on the PATH means a node
  without NVIDIA cards (a CPU node), which is a fine node: no GPUs, no error.
  ``nvidia-smi`` present but failing, hanging or printing something that is
  not the expected CSV is a failed discovery: no GPUs and an ``error`` in
  words. Nothing here raises, and the whole discovery, retries included, is
  bounded by one timeout, after which the process is killed (SIGKILL: a
  wedged nvidia-smi is not expected to honour SIGTERM).
- **Health.** Uncorrected volatile ECC errors, pending retired pages,
  remapped-row failures and remapped rows pending a reset make a GPU
  unhealthy, with the reasons in words. An unknown value (``[N/A]``: an H200
  has no page retirement) is not a problem; an unexpected one (neither a
  count nor Yes/No) is, since it cannot be vouched for.
"""

from __future__ import annotations

import re
import shutil
import signal
from collections.abc import Mapping, Sequence

import attrs
import trio

from llmgw.protocol.messages import Gpu

__all__ = [
    "ESSENTIAL_FIELDS",
    "HEALTH_FIELDS",
    "QUERY_FIELDS",
    "GpuDiscovery",
    "GpuParseError",
    "discover_gpus",
    "health_problems",
    "parse_gpu_csv",
]

ESSENTIAL_FIELDS: tuple[str, ...] = ("index", "uuid", "name", "memory.total")

ECC_UNCORRECTED = "ecc.errors.uncorrected.volatile.total"
RETIRED_PENDING = "retired_pages.pending"
REMAP_FAILURE = "remapped_rows.failure"
REMAP_PENDING = "remapped_rows.pending"
HEALTH_FIELDS: tuple[str, ...] = (ECC_UNCORRECTED, RETIRED_PENDING, REMAP_FAILURE, REMAP_PENDING)

QUERY_FIELDS: tuple[str, ...] = (
    *ESSENTIAL_FIELDS,
    "pci.bus_id",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "temperature.gpu",
    "driver_version",
    "compute_cap",
    *HEALTH_FIELDS,
)

# Integer-valued fields; anything else is kept as text.
_INT_FIELDS = frozenset(
    {
        "index",
        "memory.total",
        "memory.used",
        "memory.free",
        "utilization.gpu",
        "temperature.gpu",
        ECC_UNCORRECTED,
    }
)
_YES_NO_PROBLEMS: tuple[tuple[str, str], ...] = (
    (RETIRED_PENDING, "pending retired pages"),
    (REMAP_FAILURE, "remapped-row failure"),
    (REMAP_PENDING, "remapped rows pending a GPU reset"),
)
_UNKNOWN_WORDS = frozenset({"", "n/a", "not supported", "unknown"})
_INTEGER = re.compile(r"-?[0-9]{1,18}")  # short enough never to hit int()'s digit limit
_UNKNOWN_FIELD = re.compile(r'Field "([^"\n]*)" is not a valid field to query')
_MAX_DETAIL = 300


class GpuParseError(ValueError):
    """nvidia-smi's output is not the CSV that was asked for; the message says how."""


@attrs.frozen
class GpuDiscovery:
    gpus: list[Gpu]
    present: bool  # nvidia-smi was found
    error: str = ""  # in words; "" when fine or absent
    dropped_fields: tuple[str, ...] = ()  # fields this driver did not know


def _value(raw: str | None) -> str | None:
    """A cell's text, or None when nvidia-smi says it does not know."""
    if raw is None:
        return None
    text = raw.strip()
    if text.lower() in _UNKNOWN_WORDS or (text.startswith("[") and text.endswith("]")):
        return None
    return text


def health_problems(values: Mapping[str, str | None]) -> list[str]:
    """The health problems that a GPU's field values show, in words; [] when healthy.

    ``values`` maps field names to nvidia-smi's text; fields that are missing
    or unknown (``None``, ``[N/A]``, ...) are not problems.
    """
    problems: list[str] = []
    ecc = _value(values.get(ECC_UNCORRECTED))
    if ecc is not None:
        if _INTEGER.fullmatch(ecc):
            count = int(ecc)
            if count > 0:
                problems.append(f"{count} uncorrected ECC error{'' if count == 1 else 's'}")
        else:
            problems.append(f"uncorrected ECC error count is unreadable ({ecc!r})")
    for field, words in _YES_NO_PROBLEMS:
        answer = _value(values.get(field))
        if answer is None or answer.lower() == "no":
            continue
        if answer.lower() == "yes":
            problems.append(words)
        else:
            problems.append(f"{field} is neither Yes nor No ({answer!r})")
    return problems


def _int(values: Mapping[str, str | None], field: str, line_no: int) -> int | None:
    text = values.get(field)
    if text is None:
        return None
    if not _INTEGER.fullmatch(text):
        raise GpuParseError(f"line {line_no}: {field} is {text!r}, not a whole number")
    return int(text)


def parse_gpu_csv(text: str, fields: Sequence[str]) -> list[Gpu]:
    """GPUs from ``--query-gpu=<fields> --format=csv,noheader,nounits`` output.

    One GPU a line, cells in the order of ``fields``. Raises GpuParseError,
    in words, when a line has the wrong number of cells, a number is not a
    number, or a GPU's index is unknown.
    """
    fields = list(fields)
    gpus: list[Gpu] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = line.split(",")
        if len(cells) != len(fields):
            raise GpuParseError(
                f"line {line_no} has {len(cells)} field{'' if len(cells) == 1 else 's'},"
                f" expected {len(fields)}"
            )
        values = {field: _value(cell) for field, cell in zip(fields, cells, strict=True)}
        ints = {f: _int(values, f, line_no) for f in fields if f in _INT_FIELDS}
        index = ints.get("index")
        if index is None:
            raw = dict(zip(fields, cells, strict=True)).get("index", "").strip()
            raise GpuParseError(f"line {line_no}: the GPU's index is unknown ({raw!r})")
        problems = health_problems(values)
        gpus.append(
            Gpu(
                index=index,
                uuid=values.get("uuid") or "",
                name=values.get("name") or "",
                pci_bus_id=values.get("pci.bus_id") or "",
                memory_total_mib=ints.get("memory.total"),
                memory_used_mib=ints.get("memory.used"),
                memory_free_mib=ints.get("memory.free"),
                utilization_pct=ints.get("utilization.gpu"),
                temperature_c=ints.get("temperature.gpu"),
                driver_version=values.get("driver_version") or "",
                compute_capability=values.get("compute_cap") or "",
                healthy=not problems,
                problems=problems,
            )
        )
    return gpus


def _detail(*outputs: str) -> str:
    """The first non-empty output, on one line, cut short."""
    for out in outputs:
        words = " ".join(out.split())
        if words:
            return words if len(words) <= _MAX_DETAIL else words[: _MAX_DETAIL - 3] + "..."
    return "(no output)"


def _exit_words(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"nvidia-smi was killed by signal {-returncode} ({name})"
    return f"nvidia-smi exited {returncode}"


async def _kill(process: trio.Process) -> None:
    """deliver_cancel for run_process: SIGKILL at once, no SIGTERM grace."""
    try:
        process.kill()
    except OSError:
        pass


async def _run(argv: list[str]) -> tuple[int, str, str]:
    done = await trio.run_process(
        argv,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        deliver_cancel=_kill,
    )
    return (
        done.returncode,
        done.stdout.decode("utf-8", errors="replace"),
        done.stderr.decode("utf-8", errors="replace"),
    )


async def _query(executable: str, dropped: list[str]) -> GpuDiscovery:
    """Ask, dropping each field the driver does not know (noted in ``dropped``), then parse."""
    fields = [f for f in QUERY_FIELDS if f not in dropped]
    optional = len(QUERY_FIELDS) - len(ESSENTIAL_FIELDS)
    for _ in range(optional + 1):
        argv = [executable, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        try:
            returncode, out, err = await _run(argv)
        except FileNotFoundError:
            # Gone between shutil.which and exec: the node has no nvidia-smi.
            return GpuDiscovery(gpus=[], present=False)
        except OSError as e:
            return GpuDiscovery(
                gpus=[], present=True, error=f"could not run {executable}: {e.strerror or e}"
            )
        if returncode == 0:
            try:
                gpus = parse_gpu_csv(out, fields)
            except GpuParseError as e:
                error = f"nvidia-smi printed output that is not the expected CSV: {e}"
                return GpuDiscovery(
                    gpus=[], present=True, error=error, dropped_fields=tuple(dropped)
                )
            return GpuDiscovery(gpus=gpus, present=True, dropped_fields=tuple(dropped))
        unknown = _UNKNOWN_FIELD.search(out) or _UNKNOWN_FIELD.search(err)
        if unknown is not None:
            field = unknown.group(1)
            if field in ESSENTIAL_FIELDS:
                error = f"nvidia-smi does not know the essential field {field!r}"
            elif field not in fields:
                error = f"nvidia-smi refused field {field!r}, which was not asked for"
            else:
                fields.remove(field)
                dropped.append(field)
                continue
        else:
            error = f"{_exit_words(returncode)}: {_detail(err, out)}"
        return GpuDiscovery(gpus=[], present=True, error=error, dropped_fields=tuple(dropped))
    error = f"nvidia-smi still refused fields after dropping {', '.join(dropped)}"
    return GpuDiscovery(gpus=[], present=True, error=error, dropped_fields=tuple(dropped))


# The timeout is part of the result, not a cancellation: a hung nvidia-smi is
# reported as a failed discovery in words, and the process is killed.
async def discover_gpus(
    nvidia_smi: str = "nvidia-smi",
    *,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> GpuDiscovery:
    """The node's NVIDIA GPUs; never raises, returns within ``timeout`` seconds.

    ``nvidia_smi`` is looked up on the PATH, or used as is when it is a path.
    Not found: ``present=False`` and no error (a node without NVIDIA cards).
    """
    try:
        executable = shutil.which(nvidia_smi)
    except ValueError as e:  # e.g. an embedded NUL in a configured path
        return GpuDiscovery(
            gpus=[], present=False, error=f"{nvidia_smi!r} is not a usable path: {e}"
        )
    if executable is None:
        return GpuDiscovery(gpus=[], present=False)
    dropped: list[str] = []
    with trio.move_on_after(timeout):
        return await _query(executable, dropped)
    return GpuDiscovery(
        gpus=[],
        present=True,
        error=f"nvidia-smi timed out after {timeout:g} s",
        dropped_fields=tuple(dropped),
    )


async def gpu_processes(
    nvidia_smi: str = "nvidia-smi",
    *,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> dict[int, str]:
    """Processes holding GPU memory: pid -> GPU UUID (``--query-compute-apps``).

    Empty when there is no nvidia-smi, it fails, or it does not answer in time:
    this feeds a decision to kill, so anything uncertain means "nothing".
    """
    try:
        executable = shutil.which(nvidia_smi)
    except ValueError:
        return {}
    if executable is None:
        return {}
    argv = [executable, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader,nounits"]
    with trio.move_on_after(timeout):
        try:
            code, out, _ = await _run(argv)
        except OSError:
            return {}
        if code != 0:
            return {}
        holders: dict[int, str] = {}
        for line in out.splitlines():
            cells = [c.strip() for c in line.split(",")]
            if len(cells) == 2 and cells[0].isascii() and cells[0].isdigit():
                holders[int(cells[0])] = cells[1]
        return holders
    return {}
