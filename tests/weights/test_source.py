"""A profile's weights source: what each form means, where it lands, and what a bad
one is told."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from llmgw.weights.source import HubFile, HubRepo, MountFile, UrlFile, parse_source, where

W = Path("/var/lib/llmgw-weights")


@pytest.mark.parametrize(
    ("text", "source", "lands"),
    [
        (
            "hf://acme/tiny-GGUF/tiny-Q4_K_M.gguf",
            HubFile("acme/tiny-GGUF", "tiny-Q4_K_M.gguf"),
            "hf/acme/tiny-GGUF/main/tiny-Q4_K_M.gguf",
        ),
        (
            "hf://acme/tiny-GGUF@v1.0/q4/part-1.gguf",
            HubFile("acme/tiny-GGUF", "q4/part-1.gguf", revision="v1.0"),
            "hf/acme/tiny-GGUF/v1.0/q4/part-1.gguf",
        ),
        (
            "hf://acme/tiny@refs%2Fpr%2F1/x.gguf",
            HubFile("acme/tiny", "x.gguf", revision="refs/pr/1"),
            "hf/acme/tiny/refs%2Fpr%2F1/x.gguf",  # one folder, not three
        ),
        (
            "https://example.com/models/x.gguf",
            UrlFile("https://example.com/models/x.gguf"),
            "url/example.com/models/x.gguf",
        ),
        (
            "http://Mirror.lan:8080/a%20b/x.gguf",
            UrlFile("http://Mirror.lan:8080/a%20b/x.gguf"),
            "url/mirror.lan:8080/a b/x.gguf",
        ),
        (
            "https://example.com/x.gguf?v=2",
            UrlFile("https://example.com/x.gguf?v=2"),
            "url/example.com/q-269fc203435a/x.gguf",
        ),
    ],
)
def test_a_source_parses_and_lands_under_a_name_of_its_own(
    text: str, source: object, lands: str
) -> None:
    parsed = parse_source(text)
    assert parsed == source
    assert str(parsed) == text
    assert where(parsed, W) == W / lands


def test_a_query_lands_apart_from_another_query() -> None:
    a = where(parse_source("https://example.com/x.gguf?v=1"), W)
    b = where(parse_source("https://example.com/x.gguf?v=2"), W)
    assert a != b and a.name == b.name == "x.gguf"


def test_a_path_on_a_shared_mount_is_its_own_place() -> None:
    parsed = parse_source("/mnt/models/x.gguf")
    assert parsed == MountFile(PurePosixPath("/mnt/models/x.gguf"))
    assert where(parsed, W) == Path("/mnt/models/x.gguf")


def test_a_whole_repository_is_a_folder_whose_files_land_where_each_would() -> None:
    repo = parse_source("hf://acme/tiny-vllm@v1.0")
    assert isinstance(repo, HubRepo)
    assert (repo.repo, repo.revision) == ("acme/tiny-vllm", "v1.0")
    assert str(repo) == "hf://acme/tiny-vllm@v1.0"
    assert str(parse_source("hf://acme/tiny-vllm@main")) == "hf://acme/tiny-vllm"
    weights = Path("/w")
    file = repo.file("model-00001-of-00002.safetensors")
    assert where(file, weights) == where(repo, weights) / "model-00001-of-00002.safetensors"


def test_the_default_revision_is_written_without_it() -> None:
    assert str(parse_source("hf://acme/tiny@main/x.gguf")) == "hf://acme/tiny/x.gguf"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("s3://bucket/x.gguf", "has an unknown kind 's3': write hf://ORG/REPO/PATH/IN/REPO"),
        ("models/x.gguf", "is a relative path: write an absolute path on a mount"),
        ("hf://acme", "names no ORG/REPO: write hf://ORG/REPO/PATH/IN/REPO"),
        ("hf://acme/tiny/", "ends in '/': write hf://acme/tiny for the whole repository"),
        ("hf://acme/ti ny/x.gguf", "has 'ti ny', not a Hugging Face name"),
        ("hf://acme/a--b/x.gguf", "has 'a--b', not a Hugging Face name"),
        ("hf://acme/tiny@/x.gguf", "has the revision '', which names no branch, tag or commit"),
        ("hf://acme/tiny@a%2F..%2Fb/x.gguf", "has the revision 'a/../b', which names no"),
        ("hf://acme/tiny/../x.gguf", "has a '..' part in its path"),
        ("hf://acme/tiny/a//x.gguf", "has an empty part ('//') in its path"),
        ("https://example.com/", "names no file (its path is empty or ends in '/')"),
        ("https://example.com", "names no file"),
        ("https://user:pw@example.com/x.gguf", "carries credentials: put none in the URL"),
        ("https://example.com:99999/x.gguf", "is not a URL (Port out of range 0-65535)"),
        ("https://example.com/x.gguf#frag", "has a #fragment, which no server sees"),
        ("https://example.com/a%2Fb/x.gguf", "has a slash inside 'a/b'"),
        ("/mnt/models/", "names a folder, not a file"),
        ("/mnt/../etc/x.gguf", "has a '..' part in its path"),
        ("hf://acme/tiny/x.gguf\n", "holds a control character: write it on one line"),
    ],
)
def test_a_bad_source_says_what_is_wrong_and_what_a_good_one_is_in_one_line(
    text: str, said: str
) -> None:
    with pytest.raises(ValueError) as caught:
        parse_source(text)
    message = str(caught.value)
    assert message.startswith(f"weights source {text!r} ")
    assert said in message
    assert "\n" not in message
