"""What every daemon needs: logging, signals, and a one-line exit on bad config."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("llmgw")

EXIT_CONFIG = 2


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def fail(program: str, message: str) -> int:
    """Print the one-line error an operator acts on; the exit code for bad configuration."""
    print(f"{program}: {message}", file=sys.stderr, flush=True)
    return EXIT_CONFIG


async def run_until_signalled(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` until it returns or SIGTERM/SIGINT arrives, then cancel it.

    Shutdown is a cancellation, not a flag: every wait in the daemon unblocks
    at once, and cleanups run under their own short shielded deadlines.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    log.info("received %s; shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            await main()
            nursery.cancel_scope.cancel()


def run_daemon(
    program: str, main: Callable[[], Awaitable[None]], operator_errors: tuple[type[Exception], ...]
) -> int:
    """Run a daemon under trio; an operator's mistake found while starting (a bad
    certificate path, a bad catalog) exits 2 with its one line, not a traceback."""
    try:
        trio.run(run_until_signalled, main)
    except operator_errors as exc:
        return fail(program, str(exc))
    except BaseExceptionGroup as group:
        found = group.subgroup(operator_errors)
        if found is None:
            raise
        first = found.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return fail(program, str(first))
    return 0
