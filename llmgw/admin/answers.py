"""The management API's answers: JSON bodies, its errors, and reading a JSON body."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from llmgw.admin.views import ErrorAnswer, ErrorDetail
from llmgw.http import Request, Response

_JSON = [("content-type", "application/json")]
_T = TypeVar("_T")


def json_response(status: int, body: object) -> Response:
    return Response(status=status, headers=list(_JSON), body=msgspec.json.encode(body))


def error(status: int, message: str) -> Response:
    return json_response(status, ErrorAnswer(error=ErrorDetail(message=message, code=status)))


def json_body(request: Request, kind: type[_T], what: str) -> _T | Response:
    """The request's JSON body as ``kind``, or the 400 that says it must be ``what``."""
    try:
        return msgspec.json.decode(request.body or b"{}", type=kind)
    except msgspec.DecodeError as exc:
        return error(400, f"body must be {what}: {exc}")
    except RecursionError:  # the decoder's bound on nesting: a client's error, not ours
        return error(400, f"body must be {what}: it nests too deep")
