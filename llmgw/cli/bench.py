"""``llmgw ctl bench``: measure what a replica can serve, keep the result, compare runs,
and recommend (or write) the routing settings admission should use."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import tempfile
from pathlib import Path

import cyclopts
import msgspec
import trio

from llmgw.bench import results
from llmgw.bench.ladder import Ladder, Level, Slo, SloError, default_levels
from llmgw.bench.prompts import Dist, DistError, PromptMaker
from llmgw.bench.svg import svg as draw_svg
from llmgw.cli import catalog_edit
from llmgw.cli.admin_client import AdminClient, CtlError, Target, run_command
from llmgw.cli.bench_aim import Fleet, api_key, router_url, scrape
from llmgw.cli.defaults import not_found
from llmgw.cli.shed import shed_warnings
from llmgw.files import write_atomic

bench_app = cyclopts.App(
    name="bench",
    help="Measure what a model's replicas can serve within an SLO (see `bench compare`).",
)

PROGRAM = "llmgw ctl bench"
DEFAULT_SLO = "ttft_p95=2s,itl_p95=100ms"
EXIT_INTERRUPTED = 130  # as a shell reports a command ended by SIGINT


@bench_app.default
def bench(
    model: str,
    *,
    replica: str = "",
    slo: str = DEFAULT_SLO,
    levels: str = "",
    max_concurrency: int = 64,
    duration: float = 30.0,
    min_requests: int = 20,
    input_words: str = "256",
    output_tokens: str = "128",
    shared_prefix: int = 0,
    seed: int | None = None,
    url: str = "",
    api_key_file: Path | None = None,
    request_timeout: float = 120.0,
    out: Path | None = None,
    png: Path | None = None,
    svg: Path | None = None,
    write: bool = False,
    json: bool = False,
    target: Target | None = None,
) -> int:
    """Raise the concurrency step by step until the SLO breaks; the last level that
    met it is the capacity. Reports each level, plots it, keeps the result as JSON,
    and recommends weight, target_waiting and kv_ceiling for the profile.

    Parameters
    ----------
    model
        The catalog's model to measure.
    replica
        Aim straight at this replica (as capacity is defined) instead of through the
        router (as a client sees the fleet).
    slo
        Limits a level must meet: ttft_p50/p95, itl_p50/p95, e2e_p50/p95 (2s, 100ms),
        error_rate (1%; default: no error allowed).
    levels
        Concurrency levels, e.g. 1,2,4,8 (default 1, 2, 4, ... up to --max-concurrency).
    max_concurrency
        The highest level of the default ladder.
    duration
        Seconds each level runs (requests started by then finish).
    min_requests
        Each level runs on past --duration until this many requests have ended (at
        most ten times as long, or a minute more): a p95 of a handful of requests is
        their slowest.
    input_words
        Prompt length in words: N, uniform:LO,HI or normal:MEAN,SD.
    output_tokens
        max_tokens of each request, the same forms; replies run to it (ignore_eos).
    shared_prefix
        Start every prompt with these N words, byte for byte (to measure the prompt
        cache on purpose); by default every prompt is unique from its first word.
    seed
        Seed lengths and words (the per-request header stays random unless set).
    url
        The router's base URL (default: the server config's [router] listen), e.g.
        http://10.0.0.1:8000/v1.
    api_key_file
        A file holding an API key for the router. [env: LLMGW_API_KEY, OPENAI_API_KEY]
    request_timeout
        Seconds one request may take, end to end, before it counts as an error.
    out
        Where to keep the result (default ./llmgw-bench-MODEL-PROFILE-TIME.json),
        rewritten as each level ends: Ctrl-C keeps the levels measured.
    png
        Also draw the plot into this PNG file (needs matplotlib, which the single
        file lacks: refused before the run; --svg needs nothing).
    svg
        Also draw the plot into this SVG file (no dependency).
    write
        Put the recommended settings into the catalog (the server config's), show the
        diff to review; `llmgw ctl reload` applies them. Warns where they would make
        admission refuse load the run saw served within the SLO.
    json
        Print the result as JSON instead of a table and a plot.
    """
    try:
        return run_command(PROGRAM, lambda: _bench(
            model,
            AdminClient(target),
            replica=replica,
            slo_text=slo,
            levels_text=levels,
            max_concurrency=max_concurrency,
            duration=duration,
            min_requests=min_requests,
            input_words=input_words,
            output_tokens=output_tokens,
            shared_prefix=shared_prefix,
            seed=seed,
            url=url,
            api_key_file=api_key_file,
            request_timeout=request_timeout,
            out=out,
            png_path=png,
            svg_path=svg,
            write=write,
            as_json=json,
        ))  # fmt: skip
    except Interrupted as exc:
        print(f"{PROGRAM}: {exc}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print(f"{PROGRAM}: interrupted before any level was measured", file=sys.stderr)
        return EXIT_INTERRUPTED


class Interrupted(Exception):
    """The run was stopped by a signal; what was measured is kept (the message says where)."""


@bench_app.command
def compare(a: Path, b: Path, *, json: bool = False) -> int:
    """Set two kept results side by side, level by level (B's figures over A's).

    Parameters
    ----------
    a
        A result file of `llmgw ctl bench`.
    b
        Another.
    json
        Print both results as one JSON object ({"a": ..., "b": ...}).
    """

    def run() -> None:
        runs = [_load(p) for p in (a, b)]
        if json:
            sys.stdout.write(msgspec.json.encode({"a": runs[0], "b": runs[1]}).decode() + "\n")
        else:
            print(results.compare(*runs))

    return run_command(f"{PROGRAM} compare", run)


def _load(path: Path) -> results.Run:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return results.load(data, str(path))
    except ValueError as exc:
        raise CtlError(str(exc)) from None


def _bench(
    model: str,
    client: AdminClient,
    *,
    replica: str,
    slo_text: str,
    levels_text: str,
    max_concurrency: int,
    duration: float,
    min_requests: int,
    input_words: str,
    output_tokens: str,
    shared_prefix: int,
    seed: int | None,
    url: str,
    api_key_file: Path | None,
    request_timeout: float,
    out: Path | None,
    png_path: Path | None,
    svg_path: Path | None,
    write: bool,
    as_json: bool,
) -> None:
    try:
        slo = Slo.parse(slo_text)
        prompts = PromptMaker(
            input_words=Dist.parse(input_words, "--input-words"),
            output_tokens=Dist.parse(output_tokens, "--output-tokens"),
            shared_prefix=shared_prefix,
            seed=seed,
        )
    except (SloError, DistError) as exc:
        raise CtlError(str(exc)) from None
    if shared_prefix < 0 or max_concurrency < 1 or duration <= 0 or min_requests < 0:
        raise CtlError(
            "--shared-prefix and --min-requests must be >= 0, --max-concurrency >= 1, "
            "--duration > 0"
        )
    ladder_levels = _levels(levels_text) if levels_text else default_levels(max_concurrency)
    # what would fail after the run is refused before it: no measurement is lost to it
    if png_path is not None and (problem := results.png_problem()):
        raise CtlError(problem)
    for flag, drawing in (("--png", png_path), ("--svg", svg_path)):
        if drawing is not None:
            _check_folder(flag, drawing)
    fleet = Fleet.read(client, model)
    if replica:
        route = fleet.route(replica)
        base_url, key = route.url + "/v1", route.engine_key
        scrapes = [scrape(route)]
        aimed = results.Target(kind="replica", url=base_url, replica_id=replica)
        profiles = {fleet.replica(replica).profile}
        on = [replica]
    else:
        base_url = url.rstrip("/") or router_url(client.target)
        key = api_key(api_key_file)
        on = [r.replica_id for r in fleet.ready]
        if not on:
            raise CtlError(f"model {model} has no Ready replica: see `llmgw ctl models`")
        scrapes = [scrape(fleet.route(r)) for r in on]
        aimed = results.Target(kind="router", url=base_url, replicas=on)
        profiles = {fleet.replica(r).profile for r in on}
    profile = profiles.pop() if len(profiles) == 1 else "mixed"
    catalog = _catalog(client.target, model, profile) if write else None
    engine, version, hardware = fleet.describe(on)
    show = not as_json and sys.stderr.isatty()

    def progress(concurrency: int, elapsed: float, done: int, errors: int) -> None:
        if show:
            sys.stderr.write(
                f"\rconcurrency {concurrency:>4}: {elapsed:5.1f}/{duration:g} s, "
                f"{done} done, {errors} errors   "
            )
            sys.stderr.flush()

    ladder = Ladder(
        base_url=base_url,
        model=model,
        api_key=key,
        prompts=prompts,
        slo=slo,
        levels=ladder_levels,
        duration_s=duration,
        min_requests=min_requests,
        request_timeout_s=request_timeout,
        scrapes=scrapes,
        progress=progress,
    )

    run = results.Run(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        model=model,
        profile=profile,
        engine=engine,
        engine_version=version,
        target=aimed,
        hardware=hardware,
        slo=str(slo),
        settings={
            "input_words": str(prompts.input_words),
            "output_tokens": str(prompts.output_tokens),
            "shared_prefix": shared_prefix,
            "duration_s": duration,
            "ignore_eos": True,
        },
    )
    stamp = run.date.replace(":", "").replace("-", "").replace("+0000", "Z")
    path = out or Path(f"llmgw-bench-{model}-{profile}-{stamp}.json".replace("/", "_"))
    keeper = _Keeper(path)
    keeper.first(run)  # the folder refuses it: said now, before any request is sent

    def done(result: Level) -> None:
        run.levels.append(result)
        keeper.keep(_finish(run))
        if as_json:
            return
        if show:
            sys.stderr.write("\r" + " " * 70 + "\r")
        verdict = "met the SLO" if result.met_slo else "broke: " + "; ".join(result.broke)
        print(
            f"concurrency {result.concurrency}: {result.rps:.2f} req/s, "
            f"{result.output_tps:.1f} tok/s, TTFT p95 {_s(result.ttft_p95)}, "
            f"ITL p95 {_s(result.itl_p95)}, {result.errors} errors: {verdict}",
            file=sys.stderr,
            flush=True,
        )

    ladder.on_level = done
    signalled = _climb(ladder)
    _finish(run)
    if signalled:
        if show:
            sys.stderr.write("\r" + " " * 70 + "\r")
        measured = len(run.levels)
        during = ladder_levels[measured] if measured < len(ladder_levels) else None
        run.stopped = f"{signalled}" + (f" during concurrency {during}" if during else "")
        keeper.keep(run)
        if as_json:
            sys.stdout.write(msgspec.json.encode(run).decode() + "\n")
        capacity = (
            f"capacity so far: concurrency {run.capacity}"
            if run.capacity is not None
            else "no level met the SLO"
        )
        kept = (
            f"kept {measured} measured level{'s' if measured != 1 else ''} in {path}"
            if keeper.kept
            else f"nothing could be kept in {path}: {keeper.problem}"
        )
        raise Interrupted(f"{run.stopped}: {kept} ({capacity}); nothing written to the catalog")
    if png_path is not None:
        try:
            results.png(run, str(png_path))
        except (RuntimeError, OSError) as exc:
            raise CtlError(f"--png {png_path}: {exc}") from None
    if svg_path is not None:
        try:
            svg_path.write_text(draw_svg(run))
        except OSError as exc:
            raise CtlError(f"--svg {svg_path}: {exc.strerror or exc}") from None
    if as_json:
        sys.stdout.write(msgspec.json.encode(run).decode() + "\n")
    else:
        print(results.render(run))
        print()
        print(results.plot(run))
        drawn = ", ".join(str(p) for p in (png_path, svg_path) if p is not None)
        print(f"\nkept in {path}" + (f"; plot in {drawn}" if drawn else ""))
    _send(client, run)
    if not keeper.kept:
        raise CtlError(f"cannot keep the result in {path}: {keeper.problem}")
    if catalog is not None:
        _write(catalog, model, profile, run, quiet=as_json)


def _finish(run: results.Run) -> results.Run:
    """Capacity and recommendation from the levels so far, and where the router would
    shed by it load the run saw served."""
    results.finish(run)
    run.warnings = shed_warnings(run)
    return run


def _climb(ladder: Ladder) -> str:
    """Climb the ladder; Ctrl-C (or SIGTERM) ends it at the level it is on. Returns the
    signal's name, or "" when the ladder was climbed. The levels it ended are with its
    ``on_level``; the one it was on is dropped, being shorter than asked."""

    async def climb() -> str:
        got = ""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    nonlocal got
                    async for signum in signals:
                        got = "interrupted" if signum == signal.SIGINT else "terminated"
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(watch)
                await ladder.run()
                nursery.cancel_scope.cancel()
        return got

    try:
        return trio.run(climb)
    except BaseExceptionGroup as group:
        found = group.subgroup(CtlError)
        if found is None:
            raise
        first: BaseException = found
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


class _Keeper:
    """The result file, rewritten whole (atomically) as each level ends, so that what
    was measured is on disk whatever stops the run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kept = False
        self.problem = ""

    def first(self, run: results.Run) -> None:
        """Write the run before it starts; a folder that refuses it is said now."""
        try:
            self._write(run)
        except OSError as exc:
            folder = self.path.parent
            raise CtlError(
                f"cannot keep the result in {self.path}: {exc.strerror or exc}; give --out a"
                f" file in a folder this user can write ({folder} is not one); no request"
                " was sent"
            ) from None

    def keep(self, run: results.Run) -> None:
        """Write the run as it stands; a failure now is said once and the run goes on
        (its figures are printed at its end)."""
        try:
            self._write(run)
        except OSError as exc:
            if not self.problem:
                print(
                    f"{PROGRAM}: warning: cannot keep the result in {self.path}:"
                    f" {exc.strerror or exc}; the run goes on and is printed at its end",
                    file=sys.stderr,
                    flush=True,
                )
            self.problem = str(exc.strerror or exc)
            self.kept = False

    def _write(self, run: results.Run) -> None:
        write_atomic(self.path, msgspec.json.format(msgspec.json.encode(run)) + b"\n", 0o644)
        self.kept, self.problem = True, ""


def _send(client: AdminClient, run: results.Run) -> None:
    """Give the control plane the run, for the web console's curves; a server that does
    not take it is said in one line, and the run stands."""
    try:
        client.request("POST", "/v1/bench", dict, msgspec.to_builtins(run))
    except CtlError as exc:
        print(
            f"{PROGRAM}: warning: the server did not keep this result for its console: {exc}",
            file=sys.stderr,
            flush=True,
        )


def _check_folder(flag: str, path: Path) -> None:
    """The folder ``path`` goes in takes a file: tried with one, removed at once."""
    folder = path.parent
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".probe")
    except OSError as exc:
        raise CtlError(
            f"{flag} {path}: cannot write in {folder}: {exc.strerror or exc}; choose a folder"
            " this user can write (no request was sent)"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def _levels(text: str) -> list[int]:
    try:
        levels = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise CtlError(f"--levels {text!r}: give concurrency levels like 1,2,4,8") from None
    if not levels or any(c < 1 for c in levels) or levels != sorted(set(levels)):
        raise CtlError(f"--levels {text!r}: give rising concurrency levels of at least 1")
    return levels


# --- --write ------------------------------------------------------------------------


def _catalog(target: Target, model: str, profile: str) -> Path:
    """The catalog --write edits, checked before the run: a run is not measured to be
    refused after it, for a profile it cannot name or a file it cannot read."""
    if profile == "mixed":
        raise CtlError("--write needs one profile: aim at one replica with --replica R")
    config, _ = target.server_config()
    if config is None:
        raise CtlError(f"--write needs the server's config, for its catalog: {not_found()}")
    catalog = catalog_edit.of_server(config)
    catalog_edit.check_profile(catalog_edit.read(catalog), model, profile, str(catalog))
    return catalog


def _write(catalog: Path, model: str, profile: str, run: results.Run, *, quiet: bool) -> None:
    rec = run.recommendation
    if rec is None:
        raise CtlError("nothing to write: no level met the SLO, so there is no capacity")
    out = sys.stderr if quiet else sys.stdout
    if quiet:  # the table, which says them, was not shown
        for warning in run.warnings:
            print(f"warning: {warning}", file=out)
    diff = catalog_edit.edit(
        catalog,
        lambda text: catalog_edit.with_routing(text, model, profile, rec, str(catalog)),
        "with the recommendation",
    )
    if not diff:
        print(f"{catalog} already says so; nothing to write", file=sys.stderr)
        return
    print(diff, file=out, end="")
    print(f"wrote {catalog}: review the diff above, then `llmgw ctl reload` applies it", file=out)
