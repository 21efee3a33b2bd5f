"""The shard runner: a shard's tasks once it is launched or adopted.

Theory of operation
-------------------
Each task watches one thing and hands what it saw to the context's ``fire``
(``context.ShardContext``), which moves the shard through the lifecycle table
and sets going what the move asks for; nothing here decides a phase.

- The watcher (``run_new``, ``run_adopted``): the engine's health until it is
  ready, bounded by the spec's startup timeout (a shard with no HTTP endpoint,
  a Ray worker, is ready once it has stayed up for a moment); then, while it
  is ready, its health on an interval (``health``), each change reported; then
  its end. An end nobody asked for is a failure, reported with how the engine
  ended once what it left in its group is gone.
- The terminator (``end``): SIGTERM to the group, SIGKILL after the grace; the
  shard is gone only once no process of its group remains.
- The drainer (``drain``): until the engine has nothing in flight or the grace
  is over.
- The sleeper (``fall_asleep``), after a drain to sleep: asks the engine to
  sleep (the adapter's ``Launch.sleep_url``), bounded by ``SLEEP_CALL_S``; an
  engine that cannot (launched unable to, no answer, any answer but 200) is
  stopped instead, and the stop's reports say why (``Shard.ending_why``).
- The waker (``wake``): asks a sleeping engine to wake, then for its health,
  both within the spec's startup timeout (a wake is a quicker start); ready, its
  health is watched again. One that does not wake is ended, and fails saying why.

A sleeping engine is not health-checked (vLLM answers ``/health`` while it
sleeps, but generates nothing: 503), and is watched only for its end, which is
a failure as a ready engine's is. An adopted engine is asked whether it sleeps
(``asleep``) before its health counts as ready.

An engine that is not this agent's child (adopted) cannot be waited for: its
end is read through ``adoption.adopted_exit``.
"""

from __future__ import annotations

import logging

import attrs
import httpx
import trio

from llmgw.agent import health
from llmgw.agent.adoption import adopted_exit
from llmgw.agent.context import ShardContext, stop_grace
from llmgw.agent.launch import launch
from llmgw.agent.lifecycle import TERMINAL, Event, Phase, expects_exit
from llmgw.agent.procs import alive, describe_exit, identity, is_same_process, terminate_group
from llmgw.agent.shard import Shard
from llmgw.engines import adapters
from llmgw.http.logsafe import printable
from llmgw.protocol.messages import FetchProgress, ShardStatus
from llmgw.weights.errors import FetchError
from llmgw.weights.progress import fetching_words

log = logging.getLogger("llmgw.agent.supervisor")

HEALTH_INTERVAL_S = 0.25
WORKER_SETTLE_S = 1.0  # a shard without HTTP is ready once it stayed up this long
GIVE_UP_GRACE_S = 2.0  # SIGTERM to SIGKILL for an engine not ready in time
# the engine's sleep call at most (vLLM offloads its weights to host memory meanwhile);
# the control plane waits as long past a drain to sleep (controlplane.sleep.SLEEP_CALL_S)
SLEEP_CALL_S = 120.0
ANSWER_CLIP = 200  # of an engine's refusal, in a report
FETCH_REPORT_S = 2.0  # a fetch's progress goes to the control plane this often


def engine_auth(shard: Shard) -> dict[str, str]:
    """The header that lets the agent past its engine's key (none when it has none)."""
    key = shard.launch.engine_key if shard.launch else ""
    return {"authorization": f"Bearer {key}"} if key else {}


async def healthy(http: httpx.AsyncClient, url: str) -> bool:
    try:
        response = await http.get(url)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def run_new(ctx: ShardContext, shard: Shard) -> None:
    if await _weights(ctx, shard) and await launch(ctx, shard):
        await ctx.fetcher.used(shard.spec.model_path)
        # the startup timeout counts from here: a fetch before has its own bound
        await _until_ready(ctx, shard, deadline=trio.current_time() + shard.spec.startup_timeout_s)
        await _watch(ctx, shard)


async def _weights(ctx: ShardContext, shard: Shard) -> bool:
    """Bring the shard's weights to the node when its spec names a source (the
    fetcher); True when its engine may start. Its progress is reported every
    ``FETCH_REPORT_S`` while it lasts, and its end once; a stop or a drain
    meanwhile cancels it (what it fetched is kept for the next), and a fetch
    that fails fails the shard, saying why."""
    spec = shard.spec
    if not spec.weights_source:
        return True
    reported = [-FETCH_REPORT_S]

    def report(p: FetchProgress) -> None:
        shard.fetching = p
        now = trio.current_time()
        if now - reported[0] >= FETCH_REPORT_S:
            reported[0] = now
            shard.detail = fetching_words(p.source, p.done_bytes, p.total_bytes, p.rate_bps, p.peer)
            ctx.outbox.put(
                ShardStatus(
                    shard_id=spec.shard_id, state=shard.state, detail=shard.detail, fetching=p
                )
            )

    failed: FetchError | None = None
    with trio.CancelScope() as scope:
        shard.fetch_scope = scope  # cancelled by a move out of starting (``fire``)
        try:
            await ctx.fetcher.bring(spec, report)
        except FetchError as exc:
            failed = exc
    shard.fetch_scope = None
    was = shard.fetching
    shard.fetching = None
    if shard.phase is not Phase.STARTING:
        return False  # stopped or drained meanwhile: nothing to launch
    if failed is not None:
        ctx.fire(shard, Event.REFUSED, f"cannot fetch its weights: {failed}")
        return False
    if was is not None:  # it was fetched, not found whole: the control plane hears so
        shard.detail = "weights fetched; starting its engine"
        ctx.outbox.put(ShardStatus(shard_id=spec.shard_id, state=shard.state, detail=shard.detail))
    return True


async def run_adopted(ctx: ShardContext, shard: Shard) -> None:
    if shard.phase is Phase.STARTING:
        deadline = trio.current_time() + shard.spec.startup_timeout_s
        await _until_ready(ctx, shard, deadline=deadline)
    await _watch(ctx, shard)


async def _until_ready(ctx: ShardContext, shard: Shard, *, deadline: float) -> None:
    how = shard.launch
    assert how is not None
    settled = trio.current_time() + WORKER_SETTLE_S
    while shard.phase is Phase.STARTING:
        if not _running(shard):
            return  # _watch reports how it ended
        if how.health_url is None:
            up = trio.current_time() >= settled
        else:
            up = await healthy(ctx.http, how.health_url)
        if up:
            if shard.phase is Phase.STARTING:
                _settle_identity(ctx, shard)
            # an adopted engine may be asleep, and a sleeping vLLM answers /health
            if shard.adopted and await asleep(ctx.http, shard):
                if ctx.fire(shard, Event.SLEPT, "adopted, asleep").to is Phase.SLEEPING:
                    log.info("shard %s (adopted) is asleep", shard.shard_id)
            elif ctx.fire(shard, Event.HEALTHY, "").to is Phase.READY:
                log.info("shard %s is ready", shard.shard_id)
            return
        if trio.current_time() >= deadline:
            timeout = shard.spec.startup_timeout_s
            log.warning("shard %s: not ready within %g s; stopping it", shard.shard_id, timeout)
            shard.ending_why = f"not ready within the startup timeout of {timeout:g} s"
            ctx.fire(shard, Event.TIMED_OUT, grace=GIVE_UP_GRACE_S)
            return
        await trio.sleep(HEALTH_INTERVAL_S)


async def _watch(ctx: ShardContext, shard: Shard) -> None:
    """Until the engine ends; an end nobody asked for is a failure, with its output."""
    if shard.phase in TERMINAL:
        return
    if shard.phase is Phase.READY and shard.launch and shard.launch.health_url:
        ctx.spawn(_check_health, ctx, shard, shard.launch.health_url)
    if shard.process is not None:
        code: int | None = await shard.process.wait()
    else:
        code = await adopted_exit(shard)
    if expects_exit(shard.phase):
        return
    shard.returncode = code  # reported with the failure, as numbers (``protocol.exits``)
    why = (
        describe_exit(code)
        if code is not None
        else "exited (adopted: its exit status could not be read)"
    )
    # what the engine left behind (children in its group, a daemonized Ray head)
    # would hold its port and GPUs
    if shard.ident is not None:
        await terminate_group(
            shard.ident.pgid,
            grace=2.0,
            on_sigkill=ctx.sigkill_hook(shard, 2.0, "left running by its engine, which exited;"),
        )
    await _cleanup(shard)
    ctx.fire(shard, Event.EXITED, f"engine {why}")


async def _check_health(ctx: ShardContext, shard: Shard, url: str) -> None:
    """While it is ready: is its engine still answering? Each change is reported.
    A shard that slept and woke is watched anew, by the waker's watcher alone
    (``Shard.wakes``): this one ends at its next check."""
    sid = shard.shard_id
    wakes = shard.wakes

    def changed(up: bool, why: str) -> None:
        shard.healthy = up
        if up:
            log.info("shard %s %s", sid, why)
        else:
            log.warning("shard %s is unhealthy: %s", sid, why)
        ctx.on_event("recovered" if up else "unhealthy")
        ctx.outbox.put(
            ShardStatus(
                shard_id=sid,
                state=shard.state,
                detail=why,
                pid=shard.pid,
                healthy=up,
                engine_key=shard.launch.engine_key if shard.launch else "",
            )
        )

    try:
        await health.watch(
            lambda: healthy(ctx.http, url),
            lambda: shard.phase is Phase.READY and shard.wakes == wakes and ctx.holds(shard),
            ctx.settings.health,
            changed,
        )
    finally:
        shard.healthy = True


def _running(shard: Shard) -> bool:
    if shard.process is not None:
        return shard.process.returncode is None and alive(shard.process.pid)
    return shard.ident is not None and is_same_process(shard.ident)


async def end(ctx: ShardContext, shard: Shard, grace: float) -> None:
    """End the shard's process group (the terminator), then say how that went."""
    gone = True
    if shard.ident is not None:
        gone = await terminate_group(
            shard.ident.pgid, grace=grace, on_sigkill=ctx.sigkill_hook(shard, grace)
        )
        if shard.process is not None:
            with trio.move_on_after(5):
                await shard.process.wait()
        await _cleanup(shard)
    if shard.phase is Phase.GIVING_UP:
        ctx.fire(shard, Event.GONE if gone else Event.SURVIVED, shard.ending_why)
    elif gone:
        # "" unless it is stopped for a reason of the agent's (an engine that would
        # not sleep), which the stopped report says again
        ctx.fire(shard, Event.GONE, shard.ending_why)
    else:
        pgid = shard.ident.pgid if shard.ident else None
        ctx.fire(shard, Event.SURVIVED, f"could not stop: process group {pgid} survived SIGKILL")


async def _cleanup(shard: Shard) -> None:
    command = shard.launch.cleanup if shard.launch else None
    if not command:
        return
    with trio.move_on_after(30) as scope:
        try:
            result = await trio.run_process(
                command, capture_stdout=True, capture_stderr=True, check=False
            )
        except OSError as exc:
            log.warning("shard %s: cleanup %s failed: %s", shard.shard_id, command, exc)
            return
        if result.returncode != 0:
            log.warning(
                "shard %s: cleanup %s exited %d: %s",
                shard.shard_id,
                " ".join(command),
                result.returncode,
                result.stderr.decode(errors="replace").strip()[-300:],
            )
    if scope.cancelled_caught:
        log.warning("shard %s: cleanup %s took over 30 s", shard.shard_id, command)


async def drain(ctx: ShardContext, shard: Shard, grace: float) -> None:
    """Until nothing is in flight or the grace is over (the drainer)."""
    deadline = trio.current_time() + grace
    how = shard.launch
    while (
        shard.phase in (Phase.DRAINING, Phase.DRAINING_TO_SLEEP)
        and how is not None
        and how.metrics_url
        and trio.current_time() < deadline
    ):
        if await _idle(ctx.http, shard, how.metrics_url):
            break
        await trio.sleep(HEALTH_INTERVAL_S)
    ctx.fire(shard, Event.DRAINED, "", grace=min(stop_grace(shard.spec, ctx.settings), grace))


async def _idle(http: httpx.AsyncClient, shard: Shard, url: str) -> bool:
    adapter = adapters().get(shard.spec.engine)
    try:
        response = await http.get(url, headers=engine_auth(shard))
    except httpx.HTTPError:
        return True  # nothing answers: nothing in flight to protect
    if adapter is None or response.status_code != 200:
        return True
    load = adapter.parse_metrics(response.text)
    return not load.running and not load.waiting


async def fall_asleep(ctx: ShardContext, shard: Shard) -> None:
    """Ask the drained engine to sleep (the sleeper); stop it if it cannot."""
    sid = shard.shard_id
    url = shard.launch.sleep_url if shard.launch else None
    if url is None:
        why: str | None = "it was not started able to sleep (its spec has no sleep)"
    else:
        why = await _post(ctx.http, shard, url, SLEEP_CALL_S)
    if why is None:
        if ctx.fire(shard, Event.SLEPT, "asleep: its GPU memory is free").to is Phase.SLEEPING:
            log.info("shard %s is asleep: its engine freed its GPU memory", sid)
        return
    if shard.phase is Phase.FALLING_ASLEEP:  # else a stop or drain overtook it: no reason of ours
        shard.ending_why = f"could not sleep: {why}; stopped instead"
        log.warning("shard %s could not sleep: %s; stopping it instead", sid, why)
    grace = stop_grace(shard.spec, ctx.settings)
    ctx.fire(shard, Event.SLEEP_FAILED, shard.ending_why, grace=grace)


async def wake(ctx: ShardContext, shard: Shard) -> None:
    """Ask the sleeping engine to wake, then for its health (the waker); end it if it
    does not, within the spec's startup timeout."""
    sid = shard.shard_id
    bound = shard.spec.startup_timeout_s
    deadline = trio.current_time() + bound
    how = shard.launch
    if how is None or how.wake_url is None:
        why: str | None = "it was not started able to sleep (its spec has no sleep)"
    else:
        why = await _post(ctx.http, shard, how.wake_url, bound)
        if why is None and how.health_url is not None:
            why = await _healthy_by(ctx, shard, how.health_url, deadline)
    if why is None:
        if ctx.fire(shard, Event.HEALTHY, "awake").to is Phase.READY:
            log.info("shard %s is awake and ready", sid)
            shard.wakes += 1  # a watcher from before the sleep, if still waiting, ends
            if how is not None and how.health_url:
                ctx.spawn(_check_health, ctx, shard, how.health_url)
        return
    if shard.phase is Phase.WAKING:
        shard.ending_why = f"could not wake: {why}"
        log.warning("shard %s could not wake: %s; ending it", sid, why)
    grace = stop_grace(shard.spec, ctx.settings)
    ctx.fire(shard, Event.WAKE_FAILED, shard.ending_why, grace=grace)


async def _healthy_by(ctx: ShardContext, shard: Shard, url: str, deadline: float) -> str | None:
    """None once ``url`` answers 200 (or the shard is no longer waking: whatever
    moved it decides), else why not by ``deadline``."""
    while shard.phase is Phase.WAKING:
        if await healthy(ctx.http, url):
            return None
        if trio.current_time() >= deadline:
            bound = shard.spec.startup_timeout_s
            return f"it did not answer its health check within {bound:g} s of the wake"
        await trio.sleep(HEALTH_INTERVAL_S)
    return None


async def _post(http: httpx.AsyncClient, shard: Shard, url: str, bound: float) -> str | None:
    """POST ``url`` (with the engine's key) within ``bound`` s: None when it answered
    200, else what went wrong, in words."""
    what = f"POST {httpx.URL(url).raw_path.decode(errors='replace')}"
    silent = f"the engine did not answer {what} within {bound:g} s"
    with trio.move_on_after(bound):
        try:
            response = await http.post(url, headers=engine_auth(shard), timeout=bound)
        except httpx.TimeoutException:
            return silent
        except httpx.HTTPError as exc:
            return f"{what} failed: {printable(str(exc) or type(exc).__name__)}"
        if response.status_code == 200:
            return None
        said = printable(response.text.strip()[:ANSWER_CLIP])
        return f"the engine answered {what} with {response.status_code}" + (
            f": {said}" if said else ""
        )
    return silent


async def asleep(http: httpx.AsyncClient, shard: Shard) -> bool:
    """Whether the shard's engine says it sleeps (False: it cannot sleep, or says not,
    or nothing answers)."""
    how = shard.launch
    adapter = adapters().get(shard.spec.engine)
    if adapter is None or not adapter.sleeps or not shard.spec.sleep:
        return False
    if how is None or how.sleeping_url is None:
        return False
    try:
        response = await http.get(how.sleeping_url, headers=engine_auth(shard))
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and adapter.parse_sleeping(response.content) is True


def _settle_identity(ctx: ShardContext, shard: Shard) -> None:
    """Once ready, record the process as it is now: a launcher script may have
    exec'd the engine (``sh -c "ray start ... && exec vllm serve ..."``), and
    adoption compares command lines."""
    if shard.ident is None or shard.adopted:
        return
    now = identity(shard.ident.pid)
    if now is None or now.start_time != shard.ident.start_time or not now.cmdline:
        return
    if now.cmdline != shard.ident.cmdline:
        shard.ident = attrs.evolve(shard.ident, cmdline=now.cmdline)
        ctx.write_record(shard)
