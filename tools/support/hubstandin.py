"""A stand-in for the Hugging Face hub's file API, serving the files of a folder, for
tests and benchmarks of fetching weights (nothing here reaches the internet).

Theory of operation
-------------------
It answers what huggingface_hub's ``get_hf_file_metadata`` and a download ask,
as the hub does, so the real library works against it unchanged:

- ``HEAD``/``GET /ORG/REPO/resolve/REVISION/PATH``: the file ``ROOT/ORG/REPO/PATH``
  at any revision (``revisions``, when set, are the only ones there), with
  ``X-Repo-Commit``, the file's sha256 as its ``X-Linked-Etag`` and ``ETag``
  (every file is taken as kept in LFS), ``X-Linked-Size``, and ``Range``.
  Errors carry the hub's ``X-Error-Code``: ``RepoNotFound`` (401, as for a
  private repository asked without a token), ``RevisionNotFound``,
  ``EntryNotFound``.
- With ``cdn`` set, ``resolve`` answers ``302`` to a signed URL on another
  host name (``localhost``, the same server): the metadata on the redirect,
  the bytes at ``/cdn/SHA256``, which refuses a request that carries an
  ``Authorization`` (as S3 does a second authority beside the signature).
- ``GET /api/models/ORG/REPO/tree/REVISION``: the repository's files, as the
  hub's tree API lists them (``list_repo_tree``): sizes, and each LFS file's
  sha256 (every file but ``*.json`` and ``*.txt``).
- ``HEAD``/``GET /plain/PATH``: ``ROOT/PATH`` as a plain web server serves it:
  ``Content-Length``, a strong ``ETag``, ``Range`` and ``If-Range``.

Knobs, read at each request, so a test may turn them while it runs:
``token`` (the hub wants ``Authorization: Bearer TOKEN``), ``cut_after``
(each body ends after that many bytes, the connection closed), ``stall_after``
(each body stops after that many bytes and the connection hangs until
``close``), ``corrupt`` (one byte in the middle of every file served is
flipped; the metadata stays right), ``rate`` (bytes per second per answer),
``head_refused`` (a ``HEAD`` of ``/plain`` or ``/cdn`` is answered with this
status, as a URL signed for ``GET`` only is), ``busy`` (the next ``GET``s of
a file are answered, one each, with these statuses and ``Retry-After``
values, taken from the front), ``commit`` (what ``X-Repo-Commit`` says).
It counts what it sends (``served``, body bytes) and keeps what it was asked
(``requests``, each with when it came and the body bytes sent in answer).

``HubStandIn`` runs a threaded standard-library server on 127.0.0.1 (or ``host``), port 0
(``url`` says where), optionally with TLS; ``close`` (or leaving the
``with``) wakes what hangs, cuts open connections and joins every thread.
"""

from __future__ import annotations

import hashlib
import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

import attrs

CHUNK = 64 << 10  # per write
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@attrs.define
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    sent: int = 0  # body bytes sent in answer
    at: float = attrs.field(factory=time.monotonic)  # when it came


class HubStandIn:
    """The hub's file API over ``root``; see the module's docstring."""

    def __init__(
        self, root: Path, *, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.root = root
        self.token: str | None = None
        self.cdn = False
        self.cut_after: int | None = None
        self.stall_after: int | None = None
        self.corrupt = False
        self.rate: int | None = None
        self.revisions: set[str] | None = None
        self.head_refused: int | None = None
        self.busy: list[tuple[int, str | None]] = []  # (status, Retry-After)
        self.commit = COMMIT
        self.served = 0
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self._hashes: dict[Path, tuple[tuple[int, int, int], str]] = {}
        self._server = _Server((host, 0), _Handler)
        self._server.hub = self
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.port: int = self._server.server_address[1]
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://{host}:{self.port}"
        self.cdn_url = f"{scheme}://localhost:{self.port}"  # another host name: off the hub
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def __enter__(self) -> HubStandIn:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.closing.set()  # what stalls, stops
        self._server.shutdown()
        self._server.cut_all()
        self._server.server_close()  # joins the handlers' threads
        self._thread.join(timeout=10)

    def sha256(self, path: Path) -> str:
        """The sha256 of a file under ``root`` (cached while it is not changed)."""
        st = path.stat()
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self.lock:
            cached = self._hashes.get(path)
        if cached is not None and cached[0] == version:
            return cached[1]
        h = hashlib.sha256()
        with path.open("rb") as fh:
            while data := fh.read(1 << 20):
                h.update(data)
        with self.lock:
            self._hashes[path] = (version, h.hexdigest())
        return h.hexdigest()

    def gets(self, path_part: str = "") -> list[Request]:
        """The GETs asked so far whose path holds ``path_part``."""
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and path_part in r.path]


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close joins them: nothing is left running
    block_on_close = True
    hub: HubStandIn

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.sockets_lock:
            self.open_sockets.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.sockets_lock:
            self.open_sockets.discard(request)
        super().shutdown_request(request)

    def cut_all(self) -> None:
        with self.sockets_lock:
            for s in list(self.open_sockets):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 5.0  # an idle keep-alive connection ends, so close() never waits long
    server: _Server
    asked: Request

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read ``requests``

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        hub = self.server.hub
        self.asked = Request(
            method=self.command,
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
        )
        with hub.lock:
            hub.requests.append(self.asked)
            busy = hub.busy.pop(0) if hub.busy and self.command == "GET" else None
        path = urlsplit(self.path).path
        parts = [unquote(p) for p in path.split("/")[1:]]
        if busy is not None:
            status, after = busy
            return self._error(status, "", "busy", {"Retry-After": after} if after else {})
        if (
            hub.head_refused is not None
            and self.command == "HEAD"
            and parts[:1] in (["plain"], ["cdn"])
        ):
            # a URL signed for GET: S3 answers 403 (SignatureDoesNotMatch), others 405
            return self._error(hub.head_refused, "", "this URL is signed for GET")
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            self._tree(hub, parts[2], parts[3], parts[5], body=body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(hub, parts[0], parts[1], parts[3], parts[4:], body=body)
        elif len(parts) == 2 and parts[0] == "cdn":
            self._cdn(hub, parts[1], body=body)
        elif len(parts) >= 2 and parts[0] == "plain":
            file = _inside(hub.root, parts[1:])
            if file is None or not file.is_file():
                return self._error(404, "", "no such file")
            etag = f'"{hub.sha256(file)}"'
            self._file(hub, file, {"ETag": etag}, body=body, etag=etag)
        else:
            self._error(404, "", "no such route")
        return None

    def _resolve(
        self, hub: HubStandIn, org: str, repo: str, revision: str, path: list[str], *, body: bool
    ) -> None:
        if hub.token is not None and self.headers.get("authorization") != f"Bearer {hub.token}":
            # the hub's answer for a private repository asked without a token that may read it
            return self._error(401, "RepoNotFound", "Repository not found")
        repo_dir = _inside(hub.root, [org, repo])
        if repo_dir is None or not repo_dir.is_dir():
            return self._error(401, "RepoNotFound", "Repository not found")
        if hub.revisions is not None and revision not in hub.revisions:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        file = _inside(repo_dir, path)
        if file is None or not file.is_file():
            return self._error(404, "EntryNotFound", "Entry not found")
        sha = hub.sha256(file)
        meta = {
            "X-Repo-Commit": hub.commit,
            "X-Linked-Etag": f'"{sha}"',
            "X-Linked-Size": str(file.stat().st_size),
            "ETag": f'"{sha}"',
        }
        if hub.cdn:
            self.send_response(302)
            for k, v in meta.items():
                self.send_header(k, v)
            self.send_header("Location", f"{hub.cdn_url}/cdn/{sha}?X-Amz-Signature=s3cr3t")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        self._file(hub, file, meta, body=body, etag=None)
        return None

    def _tree(self, hub: HubStandIn, org: str, repo: str, revision: str, *, body: bool) -> None:
        """The repository's files, as the hub's tree API lists them (one page,
        recursive): each with its size, and an LFS pointer (its sha256) for every
        file but ``*.json`` and ``*.txt``, which the hub keeps in git itself."""
        if hub.token is not None and self.headers.get("authorization") != f"Bearer {hub.token}":
            return self._error(401, "RepoNotFound", "Repository not found")
        repo_dir = _inside(hub.root, [org, repo])
        if repo_dir is None or not repo_dir.is_dir():
            return self._error(401, "RepoNotFound", "Repository not found")
        if hub.revisions is not None and revision not in hub.revisions:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        entries = []
        for file in sorted(p for p in repo_dir.rglob("*") if p.is_file()):
            size = file.stat().st_size
            entry: dict[str, Any] = {
                "type": "file",
                "oid": hashlib.sha1(file.read_bytes()).hexdigest(),
                "size": size,
                "path": file.relative_to(repo_dir).as_posix(),
            }
            if file.suffix not in (".json", ".txt"):
                entry["lfs"] = {"oid": hub.sha256(file), "size": size, "pointerSize": 134}
            entries.append(entry)
        data = json.dumps(entries).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
        return None

    def _cdn(self, hub: HubStandIn, sha: str, *, body: bool) -> None:
        if "authorization" in self.headers:
            return self._error(400, "", "Only one auth mechanism allowed")
        for file in sorted(hub.root.rglob("*")):
            if file.is_file() and hub.sha256(file) == sha:
                self._file(hub, file, {"ETag": f'"cdn-{sha[:8]}"'}, body=body, etag=None)
                return None
        self._error(404, "", "no such object")
        return None

    def _file(
        self, hub: HubStandIn, file: Path, headers: dict[str, str], *, body: bool, etag: str | None
    ) -> None:
        size = file.stat().st_size
        start, end = 0, size - 1
        ranged = self.headers.get("range")
        if_range = self.headers.get("if-range")
        if ranged and (if_range is None or if_range == etag):
            got = _range(ranged, size)
            if got is None:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, end = got
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if body:
            self._send(hub, file, start, end + 1, size)

    def _send(self, hub: HubStandIn, file: Path, start: int, stop: int, size: int) -> None:
        """Bytes ``start`` to ``stop`` of ``file``, as the knobs say."""
        sent = 0
        began = time.monotonic()
        with file.open("rb") as fh:
            fh.seek(start)
            offset = start
            while offset < stop:
                n = min(CHUNK, stop - offset)
                for limit in (hub.cut_after, hub.stall_after):
                    if limit is not None:
                        n = min(n, limit - sent)
                if n <= 0:
                    if hub.stall_after is not None and sent >= hub.stall_after:
                        hub.closing.wait()
                    self.close_connection = True
                    return
                data = bytearray(fh.read(n))
                mid = size // 2
                if hub.corrupt and offset <= mid < offset + n:
                    data[mid - offset] ^= 0xFF
                if hub.rate:
                    ahead = began + (sent + n) / hub.rate - time.monotonic()
                    if ahead > 0 and hub.closing.wait(ahead):
                        self.close_connection = True
                        return
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                except OSError:
                    self.close_connection = True
                    return
                with hub.lock:
                    hub.served += n
                    self.asked.sent += n
                sent += n
                offset += n

    def _error(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        data = f'{{"error": "{message}"}}'.encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _inside(root: Path, parts: list[str]) -> Path | None:
    """``root/parts`` when it is a file or folder under ``root``; None otherwise."""
    if any(p in ("", ".", "..") or "/" in p for p in parts):
        return None
    path = root.joinpath(*parts)
    return path if path.exists() else None


def _range(header: str, size: int) -> tuple[int, int] | None:
    """The one range of ``bytes=A-B`` or ``bytes=A-`` within a file of ``size``."""
    unit, _, spec = header.partition("=")
    first, dash, last = spec.partition("-")
    if unit.strip() != "bytes" or not dash or not first.isdigit():
        return None
    start = int(first)
    end = int(last) if last.isdigit() else size - 1
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)
