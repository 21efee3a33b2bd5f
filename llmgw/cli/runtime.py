"""What every daemon needs: logging, signals, and a one-line exit on bad config."""

from __future__ import annotations

import logging
import resource
import signal
import sys
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("llmgw")

EXIT_CONFIG = 2

# Below this many open files a daemon warns: every client connection, agent
# stream and engine connection holds one.
FEW_OPEN_FILES = 4096
# Where the kernel stops (fs.nr_open's default) when the hard limit is unlimited.
NR_OPEN = 1 << 20


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


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, and log it.

    systemd's default soft limit is 1024: a few thousand idle connections
    would make ``accept`` fail for everyone. The hard limit is the ceiling an
    operator set (``LimitNOFILE`` in the unit); going up to it needs no privilege.
    Returns the soft limit in force afterwards.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NR_OPEN if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < FEW_OPEN_FILES:
        log.warning(
            "open files limit is %d: each connection holds one; raise the hard limit"
            " (LimitNOFILE= in the systemd unit, or ulimit -Hn)",
            soft,
        )
    else:
        log.info("open files limit: %d", soft)
    return soft


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
    raise_open_files_limit()
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
