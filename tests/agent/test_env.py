"""An engine's environment: the allow-list, the adapter's and profile's variables, the tag."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.agent.env import engine_env, tagged_shard
from llmgw.agent.procs import parse_environ


def test_only_allowed_variables_pass_and_the_profile_and_tag_win(tmp_path: Path) -> None:
    agent = {
        "PATH": "/usr/bin",
        "LC_ALL": "C",
        "CUDA_HOME": "/cuda",
        "HF_HOME": "/hf",
        "LLMGW_ADMIN_TOKEN": "secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "LLMGW_SHARD_ID": "forged",
    }
    env = engine_env(agent, {"CUDA_VISIBLE_DEVICES": "2", "PATH": "/opt/bin"}, "s1", tmp_path)
    assert env == {
        "PATH": "/opt/bin",
        "LC_ALL": "C",
        "CUDA_HOME": "/cuda",
        "HF_HOME": "/hf",
        "CUDA_VISIBLE_DEVICES": "2",
        "LLMGW_SHARD_ID": "s1",
        "LLMGW_STATE_DIR": os.path.realpath(tmp_path),
    }


def test_a_tag_names_its_shard_only_for_the_agent_that_wrote_it(tmp_path: Path) -> None:
    env = engine_env({}, {}, "s1", tmp_path / "a")
    assert tagged_shard(env, tmp_path / "a") == "s1"
    assert tagged_shard(env, tmp_path / "b") is None  # another agent's engine
    assert tagged_shard({"LLMGW_SHARD_ID": "s1"}, tmp_path / "a") is None
    assert tagged_shard(None, tmp_path / "a") is None
    assert tagged_shard({}, tmp_path / "a") is None


def test_environ_is_parsed_whole_and_with_garbage() -> None:
    raw = b"A=1\0B=x=y\0EMPTY=\0junk\0=novalue\0"
    assert parse_environ(raw) == {"A": "1", "B": "x=y", "EMPTY": ""}
    assert parse_environ(b"") == {}
    assert parse_environ(b"A=1") == {"A": "1"}  # no trailing NUL
