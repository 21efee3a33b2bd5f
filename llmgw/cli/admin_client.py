"""The management API as ``ctl`` speaks to it: where it is, the token that opens it,
one call at a time, and each answer decoded into its type.

Theory of operation. A ``Target`` is what the command line says about the
control plane (a server config, a URL, a token or a file holding one); an
``AdminClient`` resolves it once, at its first call, to a URL and a token, so a
command that polls reads the config and says its warnings once. Every answer
is checked twice before a command sees it:

- its status: anything but 200 is a ``CtlError`` that carries the API's own
  words (its ``ErrorAnswer``), or the start of its body when it has none;
- its shape: the body is decoded into the view the server encoded
  (``llmgw.admin.views``, the same Structs on both sides). A field this ``ctl``
  does not know is ignored; one it needs and lacks is a ``CtlError`` naming
  the path, never a traceback.

An ``Answer`` keeps the body as it came beside its view: ``--json`` prints the
API's JSON (``llmgw.cli.render.emit``), not a re-encoding of what this ``ctl``
understood, so a script sees every field of a newer server.

``run_command`` is where a command's errors end: a ``CtlError`` or a ``ConfigError``
becomes one line on stderr and exit status 2 (``runtime.fail``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import attrs
import cyclopts
import httpx
import msgspec

from llmgw.addr import url_host
from llmgw.admin.views import ErrorAnswer
from llmgw.cli.defaults import not_found, server_config
from llmgw.cli.runtime import fail
from llmgw.config import ConfigError, ServerConfig, load_config, parse_hostport
from llmgw.config.loader import read_text
from llmgw.config.schema import resolve

DEFAULT_ADMIN_URL = "http://127.0.0.1:7444"
TIMEOUT_S = 10.0

T = TypeVar("T")


class CtlError(Exception):
    """What ``ctl`` could not do, in words for the operator (no traceback)."""


def run_command(program: str, fn: Callable[[], None]) -> int:
    """Run a command's body: 0, or its error as one line and a non-zero status."""
    try:
        fn()
    except (CtlError, ConfigError) as exc:
        return fail(program, str(exc))
    return 0


@cyclopts.Parameter(name="*")
@dataclass
class Target:
    """Which control plane to talk to, and how to prove we may.

    Parameters
    ----------
    config
        The server's config file: the admin address and token are read from it.
        [env: LLMGW_SERVER_CONFIG; default /etc/llmgw/server.toml if it exists and
        no token is given]
    admin_url
        The management API's URL. [env: LLMGW_ADMIN_URL; default http://127.0.0.1:7444]
    token
        Admin bearer token; avoid it: a command line is visible to every user of
        the machine (prefer --token-file or LLMGW_ADMIN_TOKEN). [env: LLMGW_ADMIN_TOKEN]
    token_file
        File holding the admin token. [env: LLMGW_ADMIN_TOKEN_FILE]
    """

    config: Path | None = None
    admin_url: str | None = None
    token: str | None = None
    token_file: Path | None = None

    def server_config(self) -> tuple[Path | None, bool]:
        """The server's config: --config, LLMGW_SERVER_CONFIG, or /etc/llmgw/server.toml
        if it exists; and whether it is that default."""
        return server_config(self.config, os.environ)

    def resolve(self) -> tuple[str, str]:
        url = self.admin_url or os.environ.get("LLMGW_ADMIN_URL")
        if self.token:
            print(
                "llmgw ctl: warning: --token is visible to every user of this machine"
                " (ps, /proc/PID/cmdline); use --token-file FILE or LLMGW_ADMIN_TOKEN",
                file=sys.stderr,
                flush=True,
            )
        token = self.token or os.environ.get("LLMGW_ADMIN_TOKEN")
        token_file = self.token_file or _env_path("LLMGW_ADMIN_TOKEN_FILE")
        config, default = self.server_config()
        if default and (token or token_file):
            config = None  # a token given outright needs no file that may be root's
        if config is not None:
            try:
                cfg, base = load_config(ServerConfig, config)
            except ConfigError as exc:
                if not default:
                    raise
                raise CtlError(
                    f"{exc} (read by default: run ctl with sudo, or pass --config SERVER.toml"
                    " or --token-file FILE)"
                ) from None
            if url is None:
                host, port = parse_hostport(cfg.admin.listen, key="admin.listen")
                url = f"http://{url_host(host)}:{port}"
            if token is None and token_file is None:
                token = cfg.admin.token or None
                if token is None:
                    token_file = resolve(
                        base, cfg.admin.token_file or f"{cfg.state_dir}/admin-token"
                    )
        if token is None and token_file is not None:
            try:
                token = read_text(token_file).strip()
            except ConfigError as exc:
                raise CtlError(f"admin token file {exc}") from None
        if not token:
            if token_file is not None:
                raise CtlError(f"admin token file {token_file} is empty")
            raise CtlError(
                f"no admin token: {not_found()} (or give --token-file FILE or LLMGW_ADMIN_TOKEN)"
            )
        return (url or DEFAULT_ADMIN_URL).rstrip("/"), token


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


@attrs.frozen
class Answer(Generic[T]):
    """An answer of the API: its view, and its JSON as the API sent it."""

    view: T
    body: bytes


class AdminClient:
    """Calls to one control plane's management API (see the module's docstring)."""

    def __init__(self, target: Target | None = None) -> None:
        self.target = target or Target()
        self._resolved: tuple[str, str] | None = None

    def get(self, path: str, kind: type[T]) -> T:
        return self.request("GET", path, kind).view

    def request(self, method: str, path: str, kind: type[T], body: object = None) -> Answer[T]:
        """``method path`` with ``body`` as JSON, its answer decoded as ``kind``.

        Raises:
            CtlError: the API cannot be reached, refused, or answered in a shape
                this ``ctl`` cannot read.
            ConfigError: the server's config, read for the address and token, is bad.
        """
        if self._resolved is None:
            self._resolved = self.target.resolve()
        url, token = self._resolved
        try:
            response = httpx.request(
                method,
                url + path,
                headers={"authorization": f"Bearer {token}"},
                json=body,
                timeout=TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            raise CtlError(f"cannot reach the management API at {url}: {exc}") from None
        if response.status_code != 200:
            try:
                message = msgspec.json.decode(response.content, type=ErrorAnswer).error.message
            except msgspec.DecodeError:  # not the API's error: a proxy's page, say
                message = response.text.strip()[:200]
            raise CtlError(f"{url}{path}: HTTP {response.status_code}: {message}")
        try:
            view = msgspec.json.decode(response.content, type=kind)
        except msgspec.DecodeError as exc:
            raise CtlError(
                f"{url}{path}: the answer is not what this ctl reads ({exc}); is the server"
                " of another version?"
            ) from None
        return Answer(view=view, body=response.content)
