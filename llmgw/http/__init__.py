"""The lean HTTP/1.1 server shared by the admin API and the router."""

from ._throttle import Throttled
from .logsafe import printable
from .server import HttpServer
from .types import (
    Admit,
    ErrorBody,
    Handler,
    Headers,
    Request,
    Response,
    ServerLimits,
    admission,
    default_error_body,
)

__all__ = [
    "Admit",
    "ErrorBody",
    "Handler",
    "Headers",
    "HttpServer",
    "Request",
    "Response",
    "ServerLimits",
    "Throttled",
    "admission",
    "default_error_body",
    "printable",
]

from .client import ClientLimits, ResponseBody, UpstreamPool, UpstreamResponse
from .upstream_errors import (
    ConnectFailed,
    ConnectTimeout,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamReset,
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
