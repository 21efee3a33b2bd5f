"""What engines choke on is refused with a 400 before one sees it (``llmgw.router.guards``):
through ``llmgw server`` and a real llama-server, and the scanners fed edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import trio

from llmgw.router import guards
from llmgw.router.guards import Body, Limits, Refusal, gbnf_too_deep, read, regex_too_deep
from tests.conftest import Pki
from tests.engines.test_tinymodel import llama_server
from tests.realparts import needs_server
from tests.router.gateway import gateway
from tools.support.tinymodel import write_model

HI = [{"role": "user", "content": "hi"}]


def deep_grammar(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def deep_schema(depth: int) -> str:
    """A JSON schema of objects nested ``depth`` deep, as JSON text (too deep for
    Python's own encoder)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def chat_body(**fields: str) -> bytes:
    """A chat body with ``fields`` given as JSON text."""
    head = '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4'
    return (head + "".join(f',"{k}":{v}' for k, v in fields.items()) + "}").encode()


# --------------------------------------------------------------------------- processes


@needs_server
async def test_inputs_that_crash_llama_server_are_refused_before_it_sees_them(
    tmp_path: Path, pki: Pki
) -> None:
    """Measured without the guard: the grammar nested 25,000 deep and the
    response_format nested 6,000 deep each kill llama-server (SIGSEGV), and the
    1,000-deep JSON is a 500 with a traceback in the router's log. With it, each is a
    400 in OpenAI's format naming the field and the limit, the engine has processed
    no prompt token, and then serves a good request."""
    model = write_model(tmp_path / "tiny.gguf", ends_after=None)
    procs: list[trio.Process] = []
    async with (
        llama_server(model, tmp_path, procs=procs) as url,
        gateway(tmp_path, pki, [url]) as gw,
    ):
        client = openai.AsyncOpenAI(base_url=gw.base, api_key=gw.key, max_retries=0)
        with trio.fail_after(60):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model="m", messages=HI, max_tokens=4, extra_body={"grammar": deep_grammar(25_000)}
                )  # fmt: skip
            error = info.value.body
            assert isinstance(error, dict)
            assert error["param"] == "grammar" and error["code"] == "grammar_too_large"
            assert error["message"] == (
                "grammar is 48.8 KiB; the most this endpoint takes is 32 KiB "
                "(router.max_grammar_kb)"
            )

            refusals = {}
            async with httpx.AsyncClient(timeout=20) as http:
                auth = {"authorization": f"Bearer {gw.key}", "content-type": "application/json"}
                for name, body in {
                    "response_format": chat_body(
                        response_format='{"type":"json_schema","json_schema":{"name":"x",'
                        f'"schema":{deep_schema(6000)}}}}}'
                    ),
                    "json_schema": chat_body(json_schema=deep_schema(100)),
                    "x": chat_body(x="[" * 1000 + "]" * 1000),
                    "guided_regex": chat_body(guided_regex=json.dumps("(" * 300 + ")" * 300)),
                    "grammar": chat_body(stream="true", grammar=json.dumps(deep_grammar(300))),
                }.items():
                    r = await http.post(gw.base + "/chat/completions", content=body, headers=auth)
                    refusals[name] = (r.status_code, r.json()["error"])
            for name, (status, error) in refusals.items():
                assert status == 400, (name, status, error)
                assert error["type"] == "invalid_request_error", error
            assert refusals["response_format"][1]["param"] == "response_format"
            assert refusals["response_format"][1]["message"] == (
                "the body's JSON nests deeper than 128 levels in response_format "
                "(router.max_json_depth)"
            )
            assert refusals["json_schema"][1]["message"].startswith(
                "the body's JSON nests deeper than 128 levels in json_schema.properties.a."
            )
            assert refusals["x"][1]["param"] == "x"
            assert refusals["guided_regex"][1]["code"] == "grammar_too_deep"
            assert refusals["grammar"][1]["message"] == (
                "grammar nests its groups deeper than 256 levels (router.max_grammar_depth)"
            )

            # no engine saw any of them, and the engine is alive and serves
            async with httpx.AsyncClient(timeout=5) as http:
                metrics = (await http.get(url + "/metrics")).text
            assert "llamacpp:prompt_tokens_total 0" in metrics, metrics
            assert procs[0].poll() is None
            reply = await client.chat.completions.create(model="m", messages=HI, max_tokens=4)
            assert reply.choices[0].message.content
            assert await gw.sample("llmgw_router_refused_total", why="json_depth") == 3
            assert await gw.sample("llmgw_router_refused_total", why="grammar_depth") == 2
            assert await gw.sample("llmgw_router_refused_total", why="grammar_size") == 1
    assert "Traceback" not in gw.server.log()


async def test_the_admin_api_answers_deep_json_with_400(tmp_path: Path, pki: Pki) -> None:
    """1,000-deep JSON to the admin API: a 400 that says why, no traceback (it was a
    500 and a traceback in the log)."""
    async with gateway(tmp_path, pki, ["http://127.0.0.1:9"]) as gw:
        body = b'{"intent":"drain","x":' + b"[" * 1000 + b"]" * 1000 + b"}"
        with trio.fail_after(20):
            async with httpx.AsyncClient(timeout=5) as http:
                r = await http.post(
                    gw.server.admin_url + "/v1/nodes/n1",
                    content=body,
                    headers={"authorization": f"Bearer {gw.admin_token}"},
                )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == (
            'body must be JSON like {"intent": "drain"}: it nests too deep'
        )
    assert "Traceback" not in gw.server.log()


# --------------------------------------------------------------------------- the rules


def test_a_plain_body_is_read() -> None:
    body = read(chat_body(stream="true"), Limits())
    assert isinstance(body, Body) and body.model == "m" and body.stream


@pytest.mark.parametrize(
    ("fields", "why", "param"),
    [
        ({"grammar": json.dumps(deep_grammar(257))}, "grammar_depth", "grammar"),
        ({"guided_grammar": json.dumps(deep_grammar(257))}, "grammar_depth", "guided_grammar"),
        ({"grammar": json.dumps("x" * (32 * 1024 + 1))}, "grammar_size", "grammar"),
        ({"guided_choice": json.dumps(["x" * 1000] * 40)}, "grammar_size", "guided_choice"),
        ({"json_schema": json.dumps({"d": "x" * 16 * 1024})}, "schema_size", "json_schema"),
        ({"guided_json": json.dumps(deep_schema(70))}, "json_depth", "guided_json"),
        (
            {"structured_outputs": json.dumps({"regex": "(" * 257 + ")" * 257})},
            "grammar_depth",
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": json.dumps({"json": {"d": "x" * 16 * 1024}})},
            "schema_size",
            "structured_outputs.json",
        ),
        ({"tools": "[" + deep_schema(64) + "]"}, "json_depth", "tools"),
        ({"messages": "[" * 129 + "]" * 129}, "json_depth", "messages"),
    ],
)
def test_each_bound_names_its_field(fields: dict[str, str], why: str, param: str) -> None:
    found = read(chat_body(**fields), Limits())
    assert isinstance(found, Refusal), found
    assert (found.why, found.param) == (why, param), found


@pytest.mark.parametrize(
    "fields",
    [
        {"grammar": json.dumps(deep_grammar(256))},  # at the limit
        {"grammar": json.dumps('root ::= "' + "(" * 1000 + '"')},  # in a literal
        {"grammar": json.dumps("root ::= [(]" * 300)},  # in a character class
        {"grammar": json.dumps("# " + "(" * 1000 + "\nroot ::= x")},  # in a comment
        {"grammar": "12"},  # not a string: the engine's to refuse
        {"guided_regex": json.dumps(r"\(" * 300 + "[(]" * 300)},  # escaped, in a class
        {"response_format": json.dumps({"type": "json_object"})},
        {"messages": json.dumps([{"role": "user", "content": "[{" * 1000}])},
        {"tools": json.dumps([{"type": "function", "function": {"name": "f"}}] * 200)},
    ],
)
def test_what_is_within_the_bounds_passes(fields: dict[str, str]) -> None:
    assert isinstance(read(chat_body(**fields), Limits()), Body)


def test_off_is_off_and_too_deep_to_decode_is_still_a_refusal() -> None:
    off = Limits(0, 0, 0, 0)
    assert isinstance(read(chat_body(grammar=json.dumps(deep_grammar(30_000))), off), Body)
    assert isinstance(read(chat_body(x="[" * 500 + "]" * 500), off), Body)
    found = read(chat_body(x="[" * 5000 + "]" * 5000), off)
    assert isinstance(found, Refusal) and found.why == "json_depth"


def test_not_json_is_a_refusal_that_says_so() -> None:
    for data in (
        b"",
        b"{",
        b"[1]",
        b'{"model": 1}',
        chat_body() + b"garbage",
        b'"' + b"[" * 200 + b'"',
    ):
        found = read(data, Limits())
        assert isinstance(found, Refusal) and found.why == "json", data


def test_deepest_names_the_path() -> None:
    doc = {"a": [1, {"b": [[{"c": []}]]}]}
    assert guards.deepest(doc, 10) is None
    assert guards.deepest(doc, 5) == ("a", 1, "b", 0, 0)  # {"c": []} is the 6th level
    assert guards.deepest(doc, 6) == ("a", 1, "b", 0, 0, "c")
    assert guards.deepest([], 0) == ()


def test_group_nesting_scanners() -> None:
    assert gbnf_too_deep("root ::= (((a)))", 2) and not gbnf_too_deep("root ::= (((a)))", 3)
    assert not gbnf_too_deep('root ::= "\\"(((" [)] ((a))', 2)
    assert gbnf_too_deep('root ::= "\\"(((" [)] (((a)))', 2)
    assert not gbnf_too_deep("(a)(b)(c)(d)", 1)  # wide is not deep
    assert regex_too_deep("((a))", 1) and not regex_too_deep(r"\(\((a)", 1)
    assert not regex_too_deep("[]((](a)", 1) and not regex_too_deep("[^](](a)", 1)
