"""Disconnect watching: while a handler runs, notice the client leave, and cancel it.

A client that closes its connection while its request is handled should
cancel the handler at once: that is how an abandoned request cancels its
upstream work (the router's pool then closes its engine connection, and the
engine stops generating). The connection's main task is inside the handler
or writing its response then (the response is written inside the handler's
cancel scope, a streamed body included), so a second task per connection,
the watcher, reads the socket meanwhile.

The watcher is spawned on the connection's first handled request and lives
as long as the connection. Between requests it is parked
(``wait_task_rescheduled``), so the next request wakes it with one
``reschedule``, not a spawn. It watches one handler scope at a time:

- EOF or a reset sets ``peer_gone`` and cancels the handler's scope; the main
  task then ends the connection without lingering (nobody reads the answer);
- bytes that arrive instead are pipelined requests: kept in ``early``, in
  order, for the main task's next read (``Connection._recv`` takes them
  first). Past ``_EARLY_BYTES`` the watcher stops reading until the next
  request, so a client cannot make the server buffer without bound while it
  handles one request.

When the handler returns, ``Connection._handle`` clears ``handler_scope`` and
cancels ``watch_scope``, which trio turns into a synchronous withdrawal of
the watcher's readiness wait: the main task can read the socket right away.
The watcher also checks, before every read, that the scope it watches is
still the running one, so it never takes bytes meant for the main task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from ._wire import RECV_SIZE

if TYPE_CHECKING:
    from ._connection import Connection

_EARLY_BYTES = 256 * 1024  # pipelined bytes read while a handler runs, before watching pauses


def wake_watcher(conn: Connection) -> None:
    """A handler starts on ``conn``: spawn its watcher the first time, else unpark it."""
    if not conn.watcher_spawned:
        conn.watcher_spawned = True
        assert conn.nursery is not None
        conn.nursery.start_soon(_watch, conn)
    elif conn.watcher_parked:
        conn.watcher_parked = False
        assert conn.watcher is not None
        trio.lowlevel.reschedule(conn.watcher)


async def _watch(conn: Connection) -> None:
    """Watcher task: while a handler runs, read the socket to notice the client leave."""
    conn.watcher = trio.lowlevel.current_task()

    def unpark(_: Any) -> trio.lowlevel.Abort:
        conn.watcher_parked = False
        return trio.lowlevel.Abort.SUCCEEDED

    last: trio.CancelScope | None = None
    while True:
        scope = conn.handler_scope
        if scope is None or scope is last:
            conn.watcher_parked = True
            await trio.lowlevel.wait_task_rescheduled(unpark)
            continue
        last = scope
        await _watch_one(conn, scope)


async def _watch_one(conn: Connection, handler_scope: trio.CancelScope) -> None:
    sock = conn.sock
    with trio.CancelScope() as scope:
        conn.watch_scope = scope
        try:
            # Checked before every read: once the request is over, the main
            # task owns the socket's input again.
            while not scope.cancel_called and conn.handler_scope is handler_scope:
                try:
                    data = sock.recv(RECV_SIZE)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock)
                    continue
                except OSError:
                    data = b""
                if not data:
                    conn.peer_gone = True
                    handler_scope.cancel()
                    return
                # Pipelined bytes: kept for the main task, in order.
                conn.early.append(data)
                conn.early_len += len(data)
                if conn.early_len >= _EARLY_BYTES:
                    return  # stop reading until the next request
        finally:
            if conn.watch_scope is scope:
                conn.watch_scope = None
