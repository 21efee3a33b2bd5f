"""An engine's environment: a clean one, and the tag that names the shard it serves.

A clean environment
-------------------
Engines do not inherit the agent's environment. The agent's may hold secrets
(an admin token, cloud credentials, whatever the service manager put there)
that an engine has no use for, and engines run code from model repositories
and write their environment into crash reports. An engine gets:

- a short allow-list of what any program needs to run and to find its
  libraries and devices (``PATH``, ``HOME``, the locale, ``TMPDIR``,
  ``LD_LIBRARY_PATH``, and the ``CUDA_*``, ``NVIDIA_*``, ``NCCL_*`` and
  ``HF_*`` families that GPU engines and Hugging Face downloads read), taken
  from the agent's environment where set;
- what the adapter sets (the GPUs placement gave it) and the profile's
  ``env``, which win over the allow-list;
- the tag below, which wins over everything.

Anything else an engine needs goes in the profile's ``env``.

The tag
-------
Every engine carries ``LLMGW_SHARD_ID`` (its shard) and ``LLMGW_STATE_DIR``
(the state directory of the agent that started it) in its environment, and
its children inherit them. ``/proc/<pid>/environ`` is the environment a
process was started with and does not change afterwards, so a restarted agent
can recognise its own engines even when their record is lost or corrupt:
such an engine is never taken for a stray and killed. The state directory is
part of the tag so that two agents on one host never claim each other's
engines.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SHARD_VAR = "LLMGW_SHARD_ID"
STATE_DIR_VAR = "LLMGW_STATE_DIR"

#: Variables passed on from the agent's environment, by exact name.
KEEP_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "XDG_CACHE_HOME",
    }
)

#: Variables passed on from the agent's environment, by prefix.
KEEP_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "HF_")


def kept(name: str) -> bool:
    """Whether the agent's variable ``name`` reaches its engines."""
    return name in KEEP_NAMES or name.startswith(KEEP_PREFIXES)


def tag(shard_id: str, state_dir: Path) -> dict[str, str]:
    """The variables that name an engine's shard and its agent."""
    return {SHARD_VAR: shard_id, STATE_DIR_VAR: os.path.realpath(state_dir)}


def engine_env(
    agent_env: Mapping[str, str], launch_env: Mapping[str, str], shard_id: str, state_dir: Path
) -> dict[str, str]:
    """The whole environment of an engine (see the module docstring for what is in it)."""
    env = {k: v for k, v in agent_env.items() if kept(k)}
    env.update(launch_env)
    env.update(tag(shard_id, state_dir))
    return env


def tagged_shard(environ: Mapping[str, str] | None, state_dir: Path) -> str | None:
    """The shard a process's environment names, if the agent of ``state_dir`` started it."""
    if not environ:
        return None
    shard = environ.get(SHARD_VAR)
    if not shard or environ.get(STATE_DIR_VAR) != os.path.realpath(state_dir):
        return None
    return shard
