"""What the Hugging Face hub says of one file, asked through huggingface_hub.

The library knows the hub's rules, and keeping them is why it is used: the
endpoint (``HF_ENDPOINT``, for a mirror), the token (``HF_TOKEN``, else the file
``hf auth login`` wrote, unless ``HF_HUB_DISABLE_IMPLICIT_TOKEN``), offline mode
(``HF_HUB_OFFLINE``), the URL of a file at a revision (``hf_hub_url``), and what
a ``HEAD`` of it answers (``get_hf_file_metadata``): the commit the revision
is at, the file's size and, for a file kept in LFS (all weights are), its
sha256 as the linked ETag. The bytes are not fetched here (``fetch`` does that,
resumably, under trio); the library's own downloader is synchronous and keeps
its own cache layout.

The answer says where the bytes are (``location``): the hub itself, or a
CDN's signed URL it redirects to. The token goes only to the hub's own host;
a signed URL carries its own authority, and storage that is sent a second one
refuses the request.

This module is imported only when a hub source is fetched, so a node that
never fetches from the hub does not load huggingface_hub (or need it).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import attrs
import httpx
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers

from llmgw.weights.errors import FetchError
from llmgw.weights.source import HubFile, HubRepo
from llmgw.weights.transfer import describe


@attrs.frozen
class HubAnswer:
    location: str  # where the bytes are
    headers: dict[str, str]  # to send there (the token only to the hub's own host)
    size: int
    sha256: str | None  # None for a file kept in git itself, not LFS (its ETag is a git sha1)
    commit: str | None  # the revision's commit


def endpoint_of(endpoint: str | None) -> str:
    """The hub to ask: ``endpoint``, else ``HF_ENDPOINT`` as it is now, else the
    library's default (huggingface_hub reads ``HF_ENDPOINT`` once, when imported)."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def ask(source: HubFile, *, token: str | None, endpoint: str | None, timeout: float) -> HubAnswer:
    """What the hub says of ``source`` (blocking: run it in a thread). ``token``
    None follows the library's rules (``HF_TOKEN``, the login file).

    Raises:
        FetchError: the hub could not be asked, or refused; the message says
            which and what to do.
    """
    hub = endpoint_of(endpoint)
    url = hf_hub_url(source.repo, source.path, revision=source.revision, endpoint=hub)
    what = f"{source} (at {hub})"
    try:
        meta = get_hf_file_metadata(url, token=token, timeout=timeout, endpoint=hub)
    except (HfHubHTTPError, OfflineModeIsEnabled, httpx.HTTPError) as exc:
        raise _refusal(exc, what, source.repo, source.revision, source.path) from exc
    if meta.size is None:
        raise FetchError(f"{what}: the hub says no size for the file, so no room can be checked")
    etag = meta.etag or ""
    sha256 = etag.lower() if _is_sha256(etag) else None
    own_host = urlsplit(meta.location).netloc == urlsplit(url).netloc
    headers = build_hf_headers(token=token) if own_host else {}
    return HubAnswer(
        location=meta.location,
        headers=headers,
        size=meta.size,
        sha256=sha256,
        commit=meta.commit_hash,
    )


@attrs.frozen
class RepoEntry:
    """A file of a repository, as the hub lists it."""

    path: str
    size: int
    sha256: str | None  # an LFS file's; None for one kept in git itself


def list_repo(
    source: HubRepo, *, token: str | None, endpoint: str | None, timeout: float
) -> list[RepoEntry]:
    """Every file of ``source`` at its revision (blocking: run it in a thread).

    Raises:
        FetchError: the hub could not be asked, or refused, or lists no file.
    """
    hub = endpoint_of(endpoint)
    what = f"{source} (at {hub})"
    api = HfApi(endpoint=hub, token=token)
    try:
        found = [
            RepoEntry(e.path, e.size, e.lfs.sha256 if e.lfs is not None else None)
            for e in api.list_repo_tree(source.repo, revision=source.revision, recursive=True)
            if isinstance(e, RepoFile)
        ]
    except (HfHubHTTPError, OfflineModeIsEnabled, httpx.HTTPError) as exc:
        raise _refusal(exc, what, source.repo, source.revision, "") from exc
    if not found:
        raise FetchError(f"{what}: the repository has no file at {source.revision}")
    return found


def _refusal(
    exc: HfHubHTTPError | OfflineModeIsEnabled | httpx.HTTPError,
    what: str,
    repo: str,
    revision: str,
    path: str,
) -> FetchError:
    """What the hub's refusal means, in one line that says what to do."""
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, which it is
        return FetchError(
            f"{what}: {repo} is gated: accept its terms on the hub with the account"
            f" whose token this node sends (HF_TOKEN){_said(exc)}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return FetchError(
            f"{what}: the hub has no repository {repo}, or it is private and this"
            f" node sends no token that may read it (set HF_TOKEN){_said(exc)}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return FetchError(
            f"{what}: {repo} has no revision {revision!r}: name a branch, tag or commit it has"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return FetchError(
            f"{what}: {repo} at {revision} has no file {path!r}:"
            " check the name against the repository's files"
        )
    if isinstance(exc, HfHubHTTPError):
        return FetchError(f"{what}: the hub answered {exc.response.status_code}{_said(exc)}")
    if isinstance(exc, OfflineModeIsEnabled):
        return FetchError(
            f"{what}: HF_HUB_OFFLINE is set, so this node may not ask the hub: unset it,"
            " or name the weights by a path on a shared mount"
        )
    return FetchError(f"{what}: cannot reach the hub: {describe(exc)}")


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def _said(exc: HfHubHTTPError) -> str:
    said = " ".join((exc.server_message or "").split())  # one line, whatever the hub sent
    return f" (the hub: {said})" if said else ""
