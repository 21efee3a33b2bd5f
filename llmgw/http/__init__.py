"""The lean HTTP/1.1 server shared by the admin API and the router."""

from .server import HttpServer
from .types import (
    ErrorBody,
    Handler,
    Headers,
    Request,
    Response,
    ServerLimits,
    default_error_body,
)

__all__ = [
    "ErrorBody",
    "Handler",
    "Headers",
    "HttpServer",
    "Request",
    "Response",
    "ServerLimits",
    "default_error_body",
]

from .client import (
    ClientLimits,
    ConnectFailed,
    ConnectTimeout,
    ResponseBody,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamResponse,
    UpstreamTimeout,
)

__all__ += [
    "ClientLimits",
    "ConnectFailed",
    "ConnectTimeout",
    "ResponseBody",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamReset",
    "UpstreamResponse",
    "UpstreamTimeout",
]
