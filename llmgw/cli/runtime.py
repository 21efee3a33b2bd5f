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
