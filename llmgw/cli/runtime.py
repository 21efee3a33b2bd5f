"""What every daemon needs: logging, signals, and a one-line exit on bad config."""

from __future__ import annotations

import logging
import resource
import signal
import sys
from collections.abc import Awaitable, Callable

import trio

from llmgw.serve import ListenError

log = logging.getLogger("llmgw")

EXIT_CONFIG = 2

# Below this many open files a daemon warns: every client connection, agent
# stream and engine connection holds one.
FEW_OPEN_FILES = 4096
# Where the kernel stops (fs.nr_open's default) when the hard limit is unlimited.
NR_OPEN = 1 << 20


# Libraries that log every request at INFO: the router scrapes each engine's
# metrics every second and the agent checks each engine's health, so their
# lines would bury every change an operator should see. Their warnings still
# show; all of it shows at log_level = "debug".
CHATTY_LIBRARIES = ("httpx", "httpcore")


def setup_logging(level: str) -> None:
    """Log to stderr; INFO is for changes, so chatty libraries speak at WARNING and up."""
    threshold = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(
        level=threshold,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(
            logging.NOTSET if threshold <= logging.DEBUG else logging.WARNING
        )


def fail(program: str, message: str) -> int:
    """Print the one-line error an operator acts on; the exit code for bad configuration."""
    print(f"{program}: {message}", file=sys.stderr, flush=True)
    return EXIT_CONFIG


def raise_open_files_limit() -> tuple[int, str]:
    """Raise this process's soft limit on open files to its hard limit.

    systemd's default soft limit is 1024: a few thousand idle connections
    would make ``accept`` fail for everyone. The hard limit is the ceiling an
    operator set (``LimitNOFILE`` in the unit); going up to it needs no privilege.
    Returns the soft limit now in force and why it could not be raised ("" if
    it was, or needed no raising); logging is left to :func:`log_open_files`.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NR_OPEN if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, ""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        return soft, f"could not raise it to {target}: {exc}"
    return target, ""


def log_open_files(soft: int, problem: str) -> None:
    """Log the open-files limit; warn when it is low enough to refuse clients."""
    if soft != resource.RLIM_INFINITY and (problem or soft < FEW_OPEN_FILES):
        log.warning(
            "open files limit is %d%s: each connection holds one; raise the hard limit"
            " (LimitNOFILE= in the systemd unit, or ulimit -Hn)",
            soft,
            f" ({problem})" if problem else "",
        )
    else:
        log.info("open files limit: %d", soft)


async def run_until_signalled(
    main: Callable[[], Awaitable[None]], started: Callable[[], None] | None = None
) -> None:
    """Run ``main`` until it returns or SIGTERM/SIGINT arrives, then cancel it.

    Shutdown is a cancellation, not a flag: every wait in the daemon unblocks
    at once, and cleanups run under their own short shielded deadlines.

    ``started`` is called once ``main`` first yields, that is after its
    synchronous start-up checks (config files, certificates, the catalog):
    a daemon refused at start prints its one line and nothing else.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    log.info("received %s; shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            if started is not None:
                nursery.start_soon(_after_first_checkpoint, started)
            await main()
            nursery.cancel_scope.cancel()


async def _after_first_checkpoint(fn: Callable[[], None]) -> None:
    await trio.lowlevel.checkpoint()  # cancelled here if main failed before yielding
    fn()


def run_daemon(
    program: str, main: Callable[[], Awaitable[None]], operator_errors: tuple[type[Exception], ...]
) -> int:
    """Run a daemon under trio; an operator's mistake found while starting (a bad
    certificate path, a bad catalog, a port another process holds) exits 2 with
    its one line, not a traceback."""
    errors: tuple[type[Exception], ...] = (*operator_errors, ListenError)
    open_files = raise_open_files_limit()
    try:
        trio.run(run_until_signalled, main, lambda: log_open_files(*open_files))
    except errors as exc:
        return fail(program, str(exc))
    except BaseExceptionGroup as group:
        found = group.subgroup(errors)
        if found is None:
            raise
        first = found.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return fail(program, str(first))
    return 0
