"""``llmgw init``: everything a control-plane host needs, written once.

It writes, under ``--dir``: the CA and the server's certificate (``pki/``),
``server.toml`` with the catalog switched on, ``router.toml`` for the
OpenAI-compatible endpoint as a process of its own (``llmgw router``, the
``llmgw-router`` unit: a restart or an upgrade of the server cuts no client),
an example ``catalog.toml``, the admin token and an API key's hash. Then it
prints the next commands.

Running it again never overwrites anything: each file that exists is named,
one line each, and kept; only what is missing is written (a server
certificate from the existing CA, say), or nothing, and it says so. Files
with secrets are created 0600.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import stat
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import cyclopts
from cyclopts import Parameter

from llmgw.cli.defaults import DEFAULT_SERVER_CONFIG
from llmgw.config import ConfigError, ServerConfig, load_config
from llmgw.files import write_atomic
from llmgw.router.keys import hash_key, new_key
from llmgw.tls.ca import (
    CA_CERT_NAME,
    CA_KEY_NAME,
    CAError,
    describe_certificate,
    init_ca,
    issue_server,
    load_ca,
)

__all__ = ["init"]

PROG = "llmgw init"
STREAM_PORT = 7443
ADMIN_LISTEN = "127.0.0.1:7444"  # the server's admin API, which the router follows
SERVICE_USER = "llmgw"  # the user the systemd units run as

CATALOG = """\
# llmgw model catalog, written by llmgw init: which models to serve, how many
# replicas, and how to run them. Every key, with more examples (vLLM on a GPU,
# vLLM over Ray across nodes, engines run by someone else): the project's
# packaging/catalog.example.toml. After a change: llmgw ctl reload.
#
# Each model is a table under [models]; its name is what clients send as "model".
# Profiles are tried in order: each replica goes to the first that fits somewhere.

[models."qwen2.5-0.5b"]         # a name with a dot is quoted
replicas = 1

[[models."qwen2.5-0.5b".profiles]]
name = "cpu"
engine = "llama.cpp"            # "llama.cpp" | "vllm" | "vllm-ray"
gpus = 0                        # GPUs per node; 0: runs on CPU
min_memory_gb = 4               # GiB of node memory
# a GGUF file on the node (put it there, or in a weights dir every node mounts)
model_path = "/var/lib/llmgw-weights/qwen2.5-0.5b-instruct-q4_k_m.gguf"
weights = "qwen2.5-0.5b-instruct-q4_k_m"  # placement prefers nodes that hold it
settings = { context = 8192, parallel = 4 }
startup_timeout_s = 120

# [models.qwen-coder]
# replicas = 2
# [[models.qwen-coder.profiles]]
# name = "h100"
# engine = "vllm"
# gpus = 1
# model_path = "/var/lib/llmgw-weights/Qwen2.5-Coder-14B-Instruct"
# settings = { max_model_len = 16384, gpu_memory_utilization = 0.9 }
# startup_timeout_s = 900
"""


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def _q(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value, ensure_ascii=False)


def _owner(name: str | None) -> pwd.struct_passwd | None:
    if name is None:
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(SERVICE_USER)
        except KeyError:
            return None
    try:
        return pwd.getpwnam(name)
    except KeyError:
        _fail(f"--owner {name}: no such user; create it (packaging/llmgw.sysusers.conf) first")


def server_toml(*, state_dir: str, stream_listen: str, key_hash: str) -> str:
    return f"""\
# llmgw server: the control plane, written by llmgw init. Relative paths are
# resolved against this file's folder. Every key: docs/configuration.md.
# The OpenAI-compatible endpoint is not in this process: llmgw router serves it
# (router.toml, the llmgw-router unit), so a restart of this server cuts no client.

state_dir = {_q(state_dir)}         # operator intent (cordons, drains), known nodes
catalog = "catalog.toml"          # the models to run; llmgw ctl reload after a change
log_level = "info"

[agent_stream]
listen = {_q(stream_listen)}      # where agents dial in (mutual TLS)
ca = "pki/ca.pem"
cert = "pki/server.pem"           # holds every name and address agents dial
key = "pki/server-key.pem"

[admin]
listen = {_q(ADMIN_LISTEN)}         # management API and /metrics; loopback (ssh -L)
token_file = "admin-token"        # llmgw ctl --config this file reads it; so does the router

# Prometheus's own listener, with a read-only token of its own; its /sd lists every
# agent, engine and router to scrape (packaging/prometheus.yml):
# [metrics]
# listen = "0.0.0.0:9465"
# token_file = "metrics-token"

# The API keys of the endpoint: every llmgw router following this server takes them
# (hashes only) within moments of llmgw ctl reload. llmgw ctl key create NAME makes another
# key and prints its lines.
[[router.keys]]
name = "first"
sha256 = {_q(key_hash)}
models = []                       # empty: every model
"""


def router_toml(*, endpoint_listen: str) -> str:
    return f"""\
# llmgw router: the OpenAI-compatible endpoint, written by llmgw init; the
# llmgw-router unit runs it. A process of its own, so that a restart or an upgrade
# of the server cuts no client: it follows the server's routing over the admin API
# and routes on with the table it has while the server is away. Relative paths are
# resolved against this file's folder. Every key: docs/configuration.md.

admin_url = "http://{ADMIN_LISTEN}"  # the server's management API ([admin] listen)
admin_token_file = "admin-token"     # the server's admin token
workers = 2                          # processes sharing the port (SO_REUSEPORT)
log_level = "info"
# metrics_listen = "127.0.0.1:9464"  # Prometheus /metrics of every worker

[router]
listen = {_q(endpoint_listen)}
# The API keys are the server's ([[router.keys]] in server.toml), followed with its
# routing; keys listed here as well are this router's own (SIGHUP reads them again).
"""


class _Plan:
    """What one run writes and keeps, printed one line each."""

    def __init__(self) -> None:
        self.wrote: list[Path] = []
        self.kept: list[str] = []
        self.owned: dict[Path, str] = {}

    def exists(self, path: Path, what: str, detail: str = "") -> bool:
        if not path.exists():
            return False
        self.kept.append(f"{path} already exists ({what}); kept{detail}")
        return True

    def write(self, path: Path, text: str, mode: int) -> None:
        try:
            write_atomic(path, text.encode(), mode)
        except OSError as exc:
            _fail(f"cannot write {path}: {exc.strerror or exc}; check the --dir")
        self.wrote.append(path)

    def give(self, paths: list[Path], owner: pwd.struct_passwd | None) -> None:
        """The files the server reads, given to the user it runs as (they are 0600)."""
        if owner is None:
            return
        for path in paths:
            if path in self.wrote:
                try:
                    os.chown(path, owner.pw_uid, owner.pw_gid)
                except OSError as exc:
                    _fail(f"cannot give {path} to {owner.pw_name}: {exc.strerror or exc}")
                self.owned[path] = owner.pw_name

    def show(self) -> None:
        for line in self.kept:
            print(line)
        for path in self.wrote:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            who = f", owner {self.owned[path]}" if path in self.owned else ""
            print(f"wrote {path} ({mode:04o}{who})")


def init(
    *,
    dir_: Annotated[Path, Parameter(name="--dir")] = DEFAULT_SERVER_CONFIG.parent,
    name: Annotated[list[str] | None, Parameter(name="--name", negative="")] = None,
    address: Annotated[list[str] | None, Parameter(name="--address", negative="")] = None,
    state_dir: str = "/var/lib/llmgw",
    stream_listen: str = f"0.0.0.0:{STREAM_PORT}",
    endpoint_listen: str = "0.0.0.0:8000",
    owner: str | None = None,
) -> None:
    """Set up a control-plane host: the CA, the server's certificate, server.toml (with
    the catalog on), router.toml (the OpenAI-compatible endpoint, a process of its
    own), an example catalog, the admin token and an API key. Run again, it writes
    only what is missing.

    Parameters
    ----------
    dir_
        Where to write it all (pki/ under it).
    name
        A DNS name agents dial (repeatable); the server certificate holds each.
    address
        An IP address agents dial (repeatable); the server certificate holds each.
    state_dir
        The server's state_dir, written in server.toml (relative: to --dir).
    stream_listen
        Where agents dial in, HOST:PORT ([agent_stream] listen).
    endpoint_listen
        The OpenAI-compatible endpoint, HOST:PORT ([router] listen in router.toml).
    owner
        The user the server and the router run as, given the files they read that are
        0600 (the server's key, the admin token, server.toml, router.toml). Default:
        llmgw, when init runs as root and that user exists
        (packaging/llmgw.sysusers.conf); the CA's key stays root's.
    """
    hosts = [*(name or []), *(address or [])]
    if not hosts:
        _fail(
            "give every name and address agents dial to reach this host, e.g."
            " --name cp.example.net --address 10.0.0.1: the server certificate must hold them"
        )
    user = _owner(owner)
    plan = _Plan()
    pki = dir_ / "pki"
    try:
        pki.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"cannot create {pki}: {exc.strerror or exc}; run as root or choose another --dir")

    ca_cert, ca_key = pki / CA_CERT_NAME, pki / CA_KEY_NAME
    have_cert = plan.exists(ca_cert, "the CA's certificate")
    have_key = plan.exists(ca_key, "the CA's key")
    try:
        if have_cert != have_key:
            missing = ca_key if have_cert else ca_cert
            _fail(f"{missing} is missing beside the other half of the CA; restore it")
        if not have_cert:
            files = init_ca(pki)
            plan.wrote += [files.key, files.cert]
        server_cert, server_key = pki / "server.pem", pki / "server-key.pem"
        if server_cert.exists() or server_key.exists():
            held = describe_certificate(server_cert)["sans"] if server_cert.exists() else []
            detail = f": it holds {', '.join(held)}" if held else ""
            wanted = {h.strip("[]") for h in hosts}
            have = {s.split(":", 1)[1] for s in held}
            if wanted - have:
                detail += (
                    f"; not {', '.join(sorted(wanted - have))}: reissue with"
                    f" llmgw ctl cert server {' '.join(hosts)} --dir {pki}"
                )
            plan.exists(server_cert, "the server's certificate", detail)
            plan.exists(server_key, "the server's key")
        else:
            cert, key = issue_server(load_ca(pki), hosts, pki)
            plan.wrote += [key, cert]
    except CAError as exc:
        _fail(str(exc))

    token = dir_ / "admin-token"
    if not plan.exists(token, "the admin token"):
        plan.write(token, secrets.token_urlsafe(32) + "\n", 0o600)

    catalog = dir_ / "catalog.toml"
    if not plan.exists(catalog, "the catalog"):
        plan.write(catalog, CATALOG, 0o644)

    config = dir_ / "server.toml"
    api_key = ""
    if not plan.exists(config, "the server's config"):
        api_key = new_key()
        text = server_toml(
            state_dir=state_dir, stream_listen=stream_listen, key_hash=hash_key(api_key)
        )
        plan.write(config, text, 0o600)  # it names the admin token file and a key's hash

    router = dir_ / "router.toml"
    if not plan.exists(router, "the router's config"):
        plan.write(router, router_toml(endpoint_listen=endpoint_listen), 0o600)

    plan.give([pki / "server-key.pem", token, config, router], user)
    plan.show()
    if not plan.wrote:
        print(f"nothing written: {dir_} is already set up")
    if api_key:
        print(f"\nAPI key for the endpoint (shown this once; give it to clients): {api_key}")
    if config not in plan.wrote:  # kept: where agents dial is what that file says
        try:
            kept = load_config(ServerConfig, config)[0]
            stream_listen = kept.agent_stream.listen
            if kept.router.listen:
                print(
                    f"note: {config} runs the endpoint inside the server ([router] listen ="
                    f" {_q(kept.router.listen)}), which every restart of the server cuts:"
                    f" remove that line, and run llmgw router (--config {router}) instead"
                )
        except ConfigError:
            pass  # a file that does not load: the server says why when it starts
    port = stream_listen.rsplit(":", 1)[-1]
    first = hosts[0].strip("[]")
    dial = f"[{first}]:{port}" if ":" in first else f"{first}:{port}"
    # ctl finds the config by itself where init writes it by default
    to_ctl = "" if config == DEFAULT_SERVER_CONFIG else f" --config {config}"
    print(
        f"""
Next:
  systemctl enable --now llmgw-server llmgw-router
                                           # or: llmgw server --config {config}
                                           #  and llmgw router --config {router}
  llmgw ctl onboard NODE --config {config} --server {dial} --out NODE.tar
                                           # one bundle per node: its certificate and agent.toml
  # on the node, with the bundle in /etc/llmgw (see the bundle's INSTALL.txt):
  llmgw agent --check --config /etc/llmgw/agent.toml
  systemctl enable --now llmgw-agent
  llmgw ctl nodes{to_ctl}"""
    )


if __name__ == "__main__":
    cyclopts.run(init)
