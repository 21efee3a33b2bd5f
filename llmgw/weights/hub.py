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
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers

from llmgw.weights.errors import FetchError
from llmgw.weights.source import HubFile
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
    except GatedRepoError as exc:  # before RepositoryNotFoundError, which it is
        raise FetchError(
            f"{what}: {source.repo} is gated: accept its terms on the hub with the account"
            f" whose token this node sends (HF_TOKEN){_said(exc)}"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise FetchError(
            f"{what}: the hub has no repository {source.repo}, or it is private and this"
            f" node sends no token that may read it (set HF_TOKEN){_said(exc)}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise FetchError(
            f"{what}: {source.repo} has no revision {source.revision!r}: name a branch,"
            " tag or commit it has"
        ) from exc
    except RemoteEntryNotFoundError as exc:
        raise FetchError(
            f"{what}: {source.repo} at {source.revision} has no file {source.path!r}:"
            " check the name against the repository's files"
        ) from exc
    except HfHubHTTPError as exc:
        raise FetchError(
            f"{what}: the hub answered {exc.response.status_code}{_said(exc)}"
        ) from exc
    except OfflineModeIsEnabled as exc:
        raise FetchError(
            f"{what}: HF_HUB_OFFLINE is set, so this node may not ask the hub: unset it,"
            " or name the weights by a path on a shared mount"
        ) from exc
    except httpx.HTTPError as exc:
        raise FetchError(f"{what}: cannot reach the hub: {describe(exc)}") from exc
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


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def _said(exc: HfHubHTTPError) -> str:
    said = " ".join((exc.server_message or "").split())  # one line, whatever the hub sent
    return f" (the hub: {said})" if said else ""
