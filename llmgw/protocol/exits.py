"""How an engine ended: the numbers ``ShardStatus`` carries, and the words shown for them.

An agent that saw its engine end unasked reports the shard ``failed`` with
``exit_code`` (it exited) or ``signal`` (a signal ended it), as numbers, and
the same in words in ``detail`` ("engine exited with code 1", "engine killed
by signal 9 (SIGKILL)"), which a control plane older than the numbers reads.
Whoever shows an exit renders it from the numbers with these functions; only
an agent older than the numbers leaves its words to be read back
(``controlplane.failures``).
"""

from __future__ import annotations

import signal as signals


def exit_fields(returncode: int | None) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` from a returncode as ``subprocess`` gives it (negative:
    the signal that ended the process); ``(None, None)`` when it is not known."""
    if returncode is None:
        return None, None
    if returncode >= 0:
        return returncode, None
    return None, -returncode


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; a number this platform has no name for stays a number."""
    try:
        return signals.Signals(number).name
    except ValueError:
        return str(number)


def exit_words(exit_code: int | None, signal: int | None) -> str:
    """``exited with code 1``, ``killed by signal 9 (SIGKILL)``; ``exited`` when neither
    is known."""
    if signal is not None:
        name = signal_name(signal)
        return f"killed by signal {signal}" + (f" ({name})" if name != str(signal) else "")
    if exit_code is not None:
        return f"exited with code {exit_code}"
    return "exited"
