"""Where a profile's weights come from, and where they land on a node.

Theory of operation
-------------------
A profile names its weights by a source, written one of three ways:

- ``hf://ORG/REPO/PATH/IN/REPO`` (``HubFile``): a file of a Hugging Face
  repository, at revision ``main``; ``hf://ORG/REPO@REVISION/PATH`` for a
  branch, tag or commit. ``hf://ORG/REPO[@REVISION]`` (``HubRepo``): the whole
  repository, a folder (what vLLM loads); its files land where each would as a
  file source, so a file of it is fetched, shared and found the same way. A revision with a slash (``refs/pr/1``) is written
  with ``%2F``, as huggingface_hub's own ``hf://`` paths write it.
- ``https://HOST/PATH`` or ``http://HOST/PATH`` (``UrlFile``): a plain URL.
- ``/ABSOLUTE/PATH`` (``MountFile``): a file on a mount every node shares. It
  is read where it is, never copied: copying it to each node is the cost a
  shared mount is there to save.

A fetched source lands at one path under the node's weights directory, derived
from the source alone (``landing``): two profiles that name the same source
share one file, and whether a node holds a source is a look at its disk, with
no network. ``hf/ORG/REPO/REVISION/PATH`` for the hub, ``url/HOST/PATH`` for a
URL (a query adds a folder named by its hash, since the same path with another
query may be another file).

A revision that moves (a branch, ``main``) lands under the branch's name, so
a file fetched once is what the node keeps using; a profile pins a commit to
say exactly which bytes it wants.

This module is pure: it parses and names, and does no I/O.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath
from urllib.parse import quote, unquote, urlsplit

import attrs

DEFAULT_REVISION = "main"

_FORMS = "hf://ORG/REPO/PATH/IN/REPO, https://HOST/PATH or /ABSOLUTE/PATH"
# Hugging Face's own rule for an org or repo name (huggingface_hub's validate_repo_id):
# letters, digits, '-', '_' and '.', neither first nor last a '-' or '.', at most 96
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
# what git allows in a ref is wider; this is what a file name may hold without surprise
_REVISION = re.compile(r"[A-Za-z0-9._+-]+(?:/[A-Za-z0-9._+-]+)*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@attrs.frozen
class HubFile:
    """A file of a Hugging Face model repository."""

    repo: str  # ORG/REPO
    path: str  # in the repository, '/'-separated
    revision: str = DEFAULT_REVISION

    def landing(self) -> PurePosixPath:
        # the revision as one folder: refs/pr/1 must not become three
        return PurePosixPath("hf", self.repo, quote(self.revision, safe=""), self.path)

    def __str__(self) -> str:
        at = "" if self.revision == DEFAULT_REVISION else "@" + quote(self.revision, safe="")
        org, name = self.repo.split("/")
        return f"hf://{org}/{name}{at}/{self.path}"


@attrs.frozen
class HubRepo:
    """A whole Hugging Face model repository at a revision (a vLLM model's folder)."""

    repo: str  # ORG/REPO
    revision: str = DEFAULT_REVISION

    def landing(self) -> PurePosixPath:
        # its files land where each would as a HubFile: a file of it is one source too
        return PurePosixPath("hf", self.repo, quote(self.revision, safe=""))

    def file(self, path: str) -> HubFile:
        return HubFile(repo=self.repo, path=path, revision=self.revision)

    def __str__(self) -> str:
        at = "" if self.revision == DEFAULT_REVISION else "@" + quote(self.revision, safe="")
        org, name = self.repo.split("/")
        return f"hf://{org}/{name}{at}"


@attrs.frozen
class UrlFile:
    """A file at a plain http(s) URL."""

    url: str

    def landing(self) -> PurePosixPath:
        parts = urlsplit(self.url)
        host = (parts.hostname or "").lower() + (f":{parts.port}" if parts.port else "")
        segments = [unquote(s) for s in parts.path.split("/")[1:]]
        if parts.query:
            # its own folder, beside the file's name: the name stays the file's own
            tag = "q-" + hashlib.sha256(parts.query.encode()).hexdigest()[:12]
            segments.insert(len(segments) - 1, tag)
        return PurePosixPath("url", host, *segments)

    def __str__(self) -> str:
        return self.url


@attrs.frozen
class MountFile:
    """A file on a mount every node shares, used in place."""

    path: PurePosixPath

    def landing(self) -> PurePosixPath:
        return self.path

    def __str__(self) -> str:
        return str(self.path)


Source = HubFile | HubRepo | UrlFile | MountFile


def where(source: Source, weights_dir: Path) -> Path:
    """The path the source's file has on a node: under ``weights_dir`` when fetched,
    its own when on a shared mount."""
    if isinstance(source, MountFile):
        return Path(source.path)
    return weights_dir / source.landing()


def parse_source(text: str) -> Source:
    """The source ``text`` names.

    Raises:
        ValueError: ``text`` is not a source; the message, one line, says what is
            wrong and what a good one looks like.
    """
    if _CONTROL.search(text):
        raise _bad(text, "holds a control character", "write it on one line, as " + _FORMS)
    if text.startswith("hf://"):
        return _hub(text)
    if text.startswith(("https://", "http://")):
        return _url(text)
    if text.startswith("/"):
        return _mount(text)
    scheme, sep, _ = text.partition("://")
    if sep:
        raise _bad(text, f"has an unknown kind {scheme!r}", "write " + _FORMS)
    raise _bad(
        text,
        "is a relative path",
        "write an absolute path on a mount every node shares (/mnt/models/x.gguf), or " + _FORMS,
    )


def _hub(text: str) -> HubFile | HubRepo:
    example = "hf://ORG/REPO/PATH/IN/REPO (hf://ORG/REPO@REVISION/PATH for a revision)"
    org, _, rest = text.removeprefix("hf://").partition("/")
    repo_rev, _, path = rest.partition("/")
    name, at, quoted_rev = repo_rev.partition("@")
    if not org or not name:
        raise _bad(text, "names no ORG/REPO", "write " + example)
    for part in (org, name):
        if not _NAME.fullmatch(part) or "--" in part or ".." in part:
            raise _bad(
                text,
                f"has {part!r}, not a Hugging Face name",
                "ORG and REPO are letters, digits, '-', '_' and '.', as on the hub: " + example,
            )
    revision = unquote(quoted_rev) if at else DEFAULT_REVISION
    if not _REVISION.fullmatch(revision) or ".." in revision.split("/"):
        raise _bad(
            text,
            f"has the revision {revision!r}, which names no branch, tag or commit",
            "write a branch, tag or commit after '@' ('/' as %2F): hf://org/repo@v1.0/x.gguf",
        )
    if not path:
        if text.endswith("/"):
            raise _bad(text, "ends in '/'", f"write hf://{org}/{name} for the whole repository")
        return HubRepo(repo=f"{org}/{name}", revision=revision)
    _check_segments(text, path.split("/"), example)
    return HubFile(repo=f"{org}/{name}", path=path, revision=revision)


def _url(text: str) -> UrlFile:
    example = "https://HOST/PATH/TO/FILE.gguf"
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 (a port that is no number raises here)
    except ValueError as exc:
        raise _bad(text, f"is not a URL ({exc})", "write " + example) from exc
    if "@" in parts.netloc:
        raise _bad(
            text,
            "carries credentials",
            "put none in the URL (they would show in file names and logs): " + example,
        )
    if not parts.hostname:
        raise _bad(text, "names no host", "write " + example)
    if parts.fragment:
        raise _bad(text, "has a #fragment, which no server sees", "drop it: " + example)
    segments = [unquote(s) for s in parts.path.split("/")[1:]]
    if not segments or not segments[-1]:
        raise _bad(text, "names no file (its path is empty or ends in '/')", "write " + example)
    _check_segments(text, segments, example)
    return UrlFile(url=text)


def _mount(text: str) -> MountFile:
    example = "/mnt/models/x.gguf"
    segments = text.split("/")[1:]
    if not segments or not segments[-1]:
        raise _bad(text, "names a folder, not a file", "write the file's path: " + example)
    _check_segments(text, segments, example)
    return MountFile(path=PurePosixPath(text))


def _check_segments(text: str, segments: list[str], example: str) -> None:
    for s in segments:
        if s in ("", ".", ".."):
            why = "an empty part ('//')" if not s else f"a {s!r} part"
            raise _bad(text, f"has {why} in its path", "write each folder once by name: " + example)
        if "/" in s or "\\" in s:
            raise _bad(text, f"has a slash inside {s!r}", "write " + example)


def _bad(text: str, what: str, fix: str) -> ValueError:
    return ValueError(f"weights source {text!r} {what}: {fix}")
