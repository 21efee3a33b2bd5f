"""Error responses in OpenAI's shape, which the SDKs parse and show."""

from __future__ import annotations

import msgspec

from llmgw.http import Response


def openai_error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> Response:
    """``param``: the request's field at fault, if one is."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(status, [("content-type", "application/json")], msgspec.json.encode(body))


def error_body(status: int, message: str) -> tuple[str, bytes]:
    """For errors the HTTP server answers itself (413, 400, 408): OpenAI's shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return "application/json", msgspec.json.encode(body)
