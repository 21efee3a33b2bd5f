"""Never drop a stream: a stream whose engine dies mid-way goes on from another replica.

Real llama-servers of the tiny model behind the router in this process; the engine a
stream is on is killed with SIGKILL mid-stream, and the client (the real openai client)
must read exactly what an unbroken greedy run gives, under one id."""

from __future__ import annotations

import json
import signal
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
import trio

from llmgw.http.client import ClientLimits, UpstreamPool
from llmgw.router import guards
from llmgw.router.app import RouterApp
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.resume import Transcript, plan
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelRouting, Route, Snapshot
from tests.engines.test_tinymodel import PROMPT, llama_server
from tests.realparts import needs_server
from tests.router.test_app import AUTH, KEY, serve
from tools.support.tinymodel import write_model

MESSAGES = [{"role": r, "content": c} for r, c in PROMPT]
LONG = 1500  # tokens: long enough to kill the engine well before its end
# For a fault timed by what the client has read, the engine must still be at work when
# a client slowed by a busy machine has read that much: the tiny model makes thousands
# of tokens a second, and no more than the context its file declares (512 by default,
# whatever llama-server's -c says). 2,000 tokens in a 4,096 context take it about 2 s.
LONGER, LONGER_CONTEXT = 2000, 4096
KILL_AT = 240  # chunks: past what a 256-token context holds with the prompt
# a ChatML template that insists on alternating roles, as some models' templates do
TWO_USERS = [{"role": "user", "content": "Hello,"}, {"role": "user", "content": "how are you?"}]
ALTERNATE = (
    "{%- for m in messages -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{%- endif -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def llama_routes(*urls: tuple[str, str], unready: frozenset[str] = frozenset()) -> Snapshot:
    """Model ``m`` on llama-servers, by (key, url); those in ``unready`` not Ready yet."""
    routes = [
        Route(key=k, model="m", url=u, engine="llama.cpp", ready=k not in unready) for k, u in urls
    ]
    version = f"{len(urls)}-{','.join(sorted(unready))}"
    return Snapshot(version=version, models={"m": ModelRouting()}, routes=routes)


async def front(
    nursery: trio.Nursery,
    table: RoutingTable,
    pool: UpstreamPool | None = None,
    limits: guards.Limits = guards.Limits(),  # noqa: B008 (frozen)
    *,
    access_log: bool = False,
) -> tuple[RouterApp, openai.AsyncOpenAI]:
    """The router over ``table`` on loopback, and the openai client that talks to it."""
    keys = KeyRing([ApiKey("t", hash_key(KEY))])
    app = RouterApp(table, keys, pool, limits=limits, access_log=access_log)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{await serve(nursery, app)}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=60,
    )
    return app, client


@needs_server
@pytest.mark.parametrize(
    ("fault", "silent_after_s"),
    [(signal.SIGKILL, 2.0), (signal.SIGSTOP, 2.0), (signal.SIGSTOP, 0.0)],
    ids=["kill", "stop", "stop-idle"],
)
async def test_a_failed_engines_stream_goes_on_from_another_replica_exactly(
    tmp_path: Path, nursery: trio.Nursery, fault: signal.Signals, silent_after_s: float
) -> None:
    """kill -9 of the engine after 40 chunks, or SIGSTOP (its socket stays open and
    silent: found by nothing heard from it, ``router.silent_after_s``; with that off,
    by the stream's own ``idle_timeout_s``, here 2 s): the client's one stream carries
    on from the other replica, with the same id, created time and model throughout,
    and its text is byte for byte an unbroken greedy run's, with no usage the client
    did not ask for (the continuation's engine is asked for it, as every stream's is);
    the metrics count one stream resumed."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=LONGER_CONTEXT)
    procs: list[trio.Process] = []
    async with (
        llama_server(model, tmp_path, context=LONGER_CONTEXT, name="a", procs=procs) as url_a,
        llama_server(model, tmp_path, context=LONGER_CONTEXT, name="b", procs=procs) as url_b,
    ):
        table = RoutingTable(scrape_s=0.2, silent_after_s=silent_after_s)
        table.apply(llama_routes(("a", url_a)))  # the stream starts on a
        await nursery.start(table.run)
        # as by default, the stream's own idle timeout is well past the silence limit:
        # with both at 2 s, which finds the stopped engine first would be a race
        pool = UpstreamPool(ClientLimits(idle_timeout_s=10.0 if silent_after_s else 2.0))
        app, client = await front(nursery, table, pool)

        async def run(kill_after: int | None) -> tuple[str, set[tuple[str, int, str]], list]:
            text: list[str] = []
            identity: set[tuple[str, int, str]] = set()
            finishes = []
            stream = await client.chat.completions.create(
                model="m",
                messages=MESSAGES,
                max_tokens=LONGER,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
            )
            n = 0
            async for chunk in stream:
                identity.add((chunk.id, chunk.created, chunk.model))
                assert chunk.usage is None, chunk  # not asked for
                for choice in chunk.choices:
                    assert choice.index == 0
                    text.append(choice.delta.content or "")
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)
                n += 1
                if n == kill_after:
                    table.apply(llama_routes(("a", url_a), ("b", url_b)))
                    procs[0].send_signal(fault)
            return "".join(text), identity, finishes

        with trio.fail_after(120):
            reference, _, finished = await run(None)  # unbroken, on a
            assert finished == ["length"]
            resumed, identity, finished = await run(40)
        if fault == signal.SIGKILL:
            assert procs[0].poll() is not None  # a was killed mid-stream
        else:
            [ep_a] = [ep for ep in table.endpoints["m"] if ep.key == "a"]
            if silent_after_s:  # found silent, and held wedged
                assert "not a byte" in ep_a.wedged, ep_a.wedged
            else:  # the stream's own idle timeout
                assert not ep_a.wedged
                assert ep_a.breaker.consecutive_faults >= 1
        assert len(identity) == 1, identity
        assert finished == ["length"]
        assert len(resumed) == len(reference)
        assert resumed == reference
        metrics = app.metrics.registry
        assert metrics.get_sample_value("llmgw_router_streams_resumed_total", {"model": "m"}) == 1
        assert (
            metrics.get_sample_value("llmgw_router_stream_resume_gap_seconds_count", {"model": "m"})
            == 1
        )


def test_what_cannot_be_carried_on_says_why() -> None:
    """n > 1, tools, a forced format, log-probabilities: not carried on, each with its
    label; a plain chat or a completion of one prompt is."""
    cases = {
        b'{"model":"m","messages":[],"n":2}': "n",
        b'{"model":"m","messages":[],"tools":[{"type":"function"}]}': "tools",
        b'{"model":"m","messages":[],"response_format":{"type":"json_object"}}': "response_format",
        b'{"model":"m","messages":[],"logprobs":true}': "logprobs",
        b'{"model":"m","messages":[],"grammar":"root ::= x"}': "response_format",
        b'{"model":"m","messages":[],"guided_json":{}}': "response_format",
        b"[1]": "request",
    }
    for body, label in cases.items():
        found = plan(body, chat=True)
        assert getattr(found, "label", None) == label, (body, found)
    assert getattr(plan(b'{"prompt":["a","b"]}', chat=False), "label", None) == "prompt"
    assert not hasattr(plan(b'{"model":"m","messages":[]}', chat=True), "label")
    assert not hasattr(plan(b'{"model":"m","prompt":[1,2]}', chat=False), "label")


@pytest.mark.parametrize("chat", [True, False])
def test_a_continuation_is_shown_in_the_clients_shape(chat: bool) -> None:
    """A continuation's completion events come out under the original's id, created
    time, model and index, as chat deltas or completion text; the ids asked for are
    taken out of what the client sees."""
    raw = b'{"model":"m","stream":true,"max_tokens":5,"temperature":0,"prompt":"go"}'
    found = plan(raw, chat=chat)
    assert not hasattr(found, "label")
    t = found  # a Transcript
    assert t.request("llama.cpp") is not None  # type: ignore[union-attr]
    first = (
        b'data: {"id":"x1","created":7,"model":"m","object":"chat.completion.chunk",'
        b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null,'
        b'"logprobs":{"content":[{"id":42,"token":"Hi","prob":1.0,"top_probs":[]}]}}]}'
        if chat
        else b'data: {"id":"x1","created":7,"model":"m","object":"text_completion",'
        b'"choices":[{"index":0,"text":"Hi","finish_reason":null,'
        b'"logprobs":{"content":[{"id":42,"token":"Hi","prob":1.0,"top_probs":[]}]}}]}'
    )
    shown = t.observe(first)  # type: ignore[union-attr]
    assert b"42" not in shown and b'"prob"' not in shown
    # llama.cpp stamps each chunk with the second it was sent; the client sees one time
    other = plan(raw, chat=chat)
    assert isinstance(other, Transcript)
    other.request("llama.cpp")
    other.observe(first)
    later = other.observe(first.replace(b'"created":7', b'"created":8'))
    assert b'"created":7' in later and b'"created":8' not in later
    assert t.ids == [42] and t.relayed() == "Hi" and t.remaining() == 4  # type: ignore[union-attr]
    body = t.continuation([1, 2], [42])  # type: ignore[union-attr]
    assert b'"prompt":[1,2,42]' in body and b'"max_tokens":4' in body
    assert b'"temperature":0' in body and b'"n_probs":1' in body
    out = t.translate(  # type: ignore[union-attr]
        b'data: {"id":"other","created":9,"model":"x","object":"text_completion",'
        b'"choices":[{"index":0,"text":" there","finish_reason":"length",'
        b'"logprobs":{"content":[{"id":7,"token":" there","prob":1.0,"top_probs":[]}]}}]}'
    )
    assert out is not None
    assert b'"id":"x1"' in out and b'"created":7' in out and b'"model":"m"' in out
    assert (b'"delta":{"content":" there"}' if chat else b'"text":" there"') in out
    assert b'"finish_reason":"length"' in out
    assert t.ids == [42, 7]  # type: ignore[union-attr]


@pytest.mark.parametrize("asked", [True, False])
def test_a_continuations_usage_is_shown_as_openai_streams_it_and_only_when_asked(
    asked: bool,
) -> None:
    """The continuation's engine is asked for the usage (every stream's is, for its
    tenant): its last event's usage reaches a client that asked as OpenAI sends it,
    an event of its own with no choices after the last choice's, counting the whole
    stream; a client that did not ask sees none."""
    options = ',"stream_options":{"include_usage":true}' if asked else ""
    raw = b'{"model":"m","stream":true,"max_tokens":5,"prompt":"go"%s}' % options.encode()
    t = plan(raw, chat=True)
    assert isinstance(t, Transcript)
    t.request("llama.cpp")
    t.observe(
        b'data: {"id":"x1","created":7,"model":"m","object":"chat.completion.chunk",'
        b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null,'
        b'"logprobs":{"content":[{"id":42,"token":"Hi","prob":1.0,"top_probs":[]}]}}]}'
    )
    t.continuation([1, 2, 3], [42])
    out = t.translate(
        b'data: {"id":"o","created":9,"model":"x","object":"text_completion",'
        b'"choices":[{"index":0,"text":" there","finish_reason":"length",'
        b'"logprobs":{"content":[{"id":7,"token":" there","prob":1.0,"top_probs":[]}]}}],'
        b'"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}'
    )
    assert out is not None
    events = [json.loads(e.removeprefix(b"data: ")) for e in out.split(b"\n\n")]
    assert events[0]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[0]
    if asked:
        assert len(events) == 2
        assert events[1]["choices"] == [] and events[1]["id"] == "x1"
        assert events[1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    else:
        assert len(events) == 1


@needs_server
async def test_a_sampled_stream_carries_on_from_where_it_stopped(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """With sampling there is no reference to compare with, but the stream must go on
    from the token it stopped at: what was read before the kill is the start of the
    whole text, the usage counts exactly ``max_tokens`` generated, and one identity."""
    model = write_model(tmp_path / "never.gguf", ends_after=None)
    procs: list[trio.Process] = []
    async with (
        llama_server(model, tmp_path, context=2048, name="a", procs=procs) as url_a,
        llama_server(model, tmp_path, context=2048, name="b", procs=procs) as url_b,
    ):
        table = RoutingTable(scrape_s=60)
        table.apply(llama_routes(("a", url_a)))
        app, client = await front(nursery, table)
        pieces: list[str] = []
        before = ""
        identity: set[tuple[str, int, str]] = set()
        usage = None
        with trio.fail_after(120):
            stream = await client.chat.completions.create(
                model="m",
                messages=MESSAGES,
                max_tokens=400,
                temperature=1.0,
                extra_body={"top_k": 40, "seed": 7},
                stream=True,
                stream_options={"include_usage": True},
            )
            n = 0
            async for chunk in stream:
                identity.add((chunk.id, chunk.created, chunk.model))
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                n += 1
                if n == 40:
                    before = "".join(pieces)
                    table.apply(llama_routes(("a", url_a), ("b", url_b)))
                    procs[0].send_signal(signal.SIGKILL)
    text = "".join(pieces)
    assert procs[0].poll() is not None
    assert len(identity) == 1, identity
    assert before and text.startswith(before) and len(text) > len(before)
    assert usage is not None and usage.completion_tokens == 400
    assert (
        app.metrics.registry.get_sample_value("llmgw_router_streams_resumed_total", {"model": "m"})
        == 1
    )


async def _cutting_proxy(nursery: trio.Nursery, upstream: str, cut: list[int]) -> str:
    """A loopback TCP relay to ``upstream`` that, while ``cut[0]`` > 0, passes a
    response's head and the first bytes of its body and then drops both connections
    (an engine dying between its head and the end of its body); its base URL."""
    host, port = upstream.removeprefix("http://").split(":")

    async def handle(client: trio.SocketStream) -> None:
        async with (
            client,
            await trio.open_tcp_stream(host, int(port)) as engine,
            trio.open_nursery() as inner,
        ):

            async def forward() -> None:
                async for data in client:
                    await engine.send_all(data)
                inner.cancel_scope.cancel()  # the router closed it

            inner.start_soon(forward)
            held = b""  # of a response to cut, until its head is whole
            async for data in engine:
                if not cut[0]:
                    await client.send_all(data)
                    continue
                held += data
                if b"\r\n\r\n" in held:
                    cut[0] -= 1
                    await client.send_all(held[: held.index(b"\r\n\r\n") + 4 + 8])
                    break
            inner.cancel_scope.cancel()

    listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


@needs_server
async def test_a_whole_reply_cut_after_its_head_is_asked_again_of_another_replica(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A non-streamed chat whose replica sends its head and eight bytes of its body and
    then drops the connection is sent whole to the other replica: the client gets one
    complete answer, the same greedy text as an unbroken one, and the break counts
    against the first replica."""
    model = write_model(tmp_path / "never.gguf", ends_after=None)
    async with (
        llama_server(model, tmp_path, name="a") as url_a,
        llama_server(model, tmp_path, name="b") as url_b,
    ):
        cut = [0]
        via = await _cutting_proxy(nursery, url_a, cut)
        table = RoutingTable(scrape_s=60)
        table.apply(llama_routes(("a", via)))
        app, client = await front(nursery, table)
        with trio.fail_after(60):
            whole = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=64, temperature=0
            )
            table.apply(llama_routes(("a", via), ("b", url_b)))
            cut[0] = 1  # the next answer from a is cut; either replica may be picked
            answers = []
            while cut[0] and len(answers) < 30:
                again = await client.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=64, temperature=0
                )
                answers.append((again.choices[0].message.content, again.usage))
    assert cut == [0]  # an answer of a's was cut
    for text, usage in answers:
        assert text == whole.choices[0].message.content
        assert usage is not None and usage.completion_tokens == 64
    errors = app.metrics.upstream_errors.labels("m", "a", "reset")._value.get()
    assert errors == 1


@needs_server
@pytest.mark.parametrize(
    ("case", "label", "words"),
    [
        ("n", "n", "could not go on elsewhere: it asked for n=2 choices"),
        ("small", "refused", "could not go on elsewhere: replica b refused the continuation"),
        ("alone", "no_replica", "could not go on elsewhere: no other Ready replica of m"),
        ("template", "refused", "Conversation roles must alternate"),
        # a continuation would drop the grammar: a kept constraint, or an error event
        ("grammar", "response_format", "it constrained its output (grammar)"),
    ],
)
async def test_a_stream_that_cannot_go_on_ends_with_an_error_event_that_says_why(
    tmp_path: Path, nursery: trio.Nursery, case: str, label: str, words: str
) -> None:
    """Killed mid-way, a stream that cannot be carried on ends with an error event in
    OpenAI's format, never a silent cut: one that asked for two choices; one whose
    continuation the other replica refuses (its 256-token context is too small for the
    prompt and the 240 tokens relayed: llama-server's own 400); one the other replica
    cannot render (two user messages in a row, which its chat template refuses, as
    some models' do, where the first replica's renders them);
    one with no other replica. The metric counts it by why."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=LONGER_CONTEXT)
    procs: list[trio.Process] = []
    template = tmp_path / "alternate.jinja"
    template.write_text(ALTERNATE)
    b_args = ("--jinja", "--chat-template-file", str(template)) if case == "template" else ()
    async with (
        llama_server(
            model, tmp_path, context=LONGER_CONTEXT, name="a", procs=procs, parallel=2
        ) as url_a,
        llama_server(
            model,
            tmp_path,
            context=256 if case == "small" else LONGER_CONTEXT,
            name="b",
            procs=procs,
            args=b_args,
        ) as url_b,
    ):
        table = RoutingTable(scrape_s=60)
        table.apply(llama_routes(("a", url_a)))
        app, client = await front(nursery, table)
        read: list[object] = []

        async def stream_it() -> None:
            stream = await client.chat.completions.create(
                model="m",
                messages=TWO_USERS if case == "template" else MESSAGES,
                # far past KILL_AT (see LONGER), within a's slots' 2,048 each
                max_tokens=1800,
                temperature=0,
                n=2 if case == "n" else 1,
                stream=True,
                extra_body={"grammar": "root ::= [a-z ]+"} if case == "grammar" else None,
            )
            async for chunk in stream:
                read.append(chunk)
                if len(read) == KILL_AT:
                    if case != "alone":
                        table.apply(llama_routes(("a", url_a), ("b", url_b)))
                    procs[0].send_signal(signal.SIGKILL)

        with trio.fail_after(60), pytest.raises(openai.APIError) as raised:
            await stream_it()
    assert len(read) >= KILL_AT  # what was sent stands
    assert "the reply was cut short: replica a failed mid-stream" in raised.value.message
    assert words in raised.value.message, raised.value.message
    metrics = app.metrics.registry
    assert (
        metrics.get_sample_value(
            "llmgw_router_streams_not_resumed_total", {"model": "m", "why": label}
        )
        == 1
    )
    assert metrics.get_sample_value("llmgw_router_streams_resumed_total", {"model": "m"}) in (
        None,
        0,
    )


@needs_server
async def test_every_stream_on_a_killed_engine_goes_on_queued_or_begun(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Twelve streams at a one-slot llama-server: one generating, eleven queued behind
    it with no byte yet; then kill -9, as another replica becomes Ready. The begun one
    is carried on; the queued ones, whose connections close without an answer, are
    sent to the other replica, all eleven, though the retry budget allows three in
    this window: a dead engine did no work for them. Every stream ends whole."""
    model = write_model(tmp_path / "never.gguf", ends_after=None)
    procs: list[trio.Process] = []
    async with (
        llama_server(model, tmp_path, context=2048, name="a", procs=procs) as url_a,
        llama_server(model, tmp_path, context=2048, name="b", procs=procs, parallel=12) as url_b,
    ):
        table = RoutingTable(scrape_s=60)
        table.apply(llama_routes(("a", url_a), ("b", url_b), unready=frozenset({"b"})))
        app = RouterApp(table, KeyRing([ApiKey("t", hash_key(KEY))]))
        base = f"http://127.0.0.1:{await serve(nursery, app)}/v1"
        [ep_a, _] = table.endpoints["m"]
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 300, "temperature": 0,
                "stream": True}  # fmt: skip
        ends: list[str] = []
        begun = trio.Event()

        async def one(client: httpx.AsyncClient) -> None:
            async with client.stream(
                "POST", base + "/chat/completions", json=body, headers=AUTH
            ) as r:
                lines = []
                async for line in r.aiter_lines():
                    begun.set()
                    if line:
                        lines.append(line)
            done = any('"finish_reason":"length"' in x for x in lines)
            error = any('"error"' in x for x in lines)
            whole = r.status_code == 200 and done and not error and lines[-1] == "data: [DONE]"
            ends.append("whole" if whole else f"{r.status_code}: {lines[-2:]}")

        with trio.fail_after(90):
            async with (
                httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=20)) as client,
                trio.open_nursery() as clients,
            ):
                for _ in range(12):
                    clients.start_soon(one, client)
                await begun.wait()
                while ep_a.in_flight < 12:
                    await trio.sleep(0.01)
                table.apply(llama_routes(("a", url_a), ("b", url_b)))
                procs[0].send_signal(signal.SIGKILL)
    assert ends == ["whole"] * 12, ends
