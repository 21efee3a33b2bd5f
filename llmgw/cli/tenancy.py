"""``llmgw ctl tenant ...`` and ``llmgw ctl key ...``: tenants and their API keys.

Through the management API (``llmgw.admin.tenancy``): every change is saved by
the control plane before it answers, and reaches every router within a second.
``ctl key create`` without ``--tenant`` makes a key for a config file instead
(``[[router.keys]]``), as before tenants: printed, not sent anywhere.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from urllib.parse import quote

import cyclopts

from llmgw.admin.views import (
    KeyCreated,
    KeyList,
    KeyView,
    TenancyAnswer,
    TenantList,
    TenantView,
    UsageList,
)
from llmgw.cli.admin_client import AdminClient, CtlError, Target, run_command
from llmgw.cli.ctl import _show as show
from llmgw.cli.render import emit, table

tenant_app = cyclopts.App(
    name="tenant",
    help="Tenants: who keys belong to, the models they may use, their limits.",
)
key_app = cyclopts.App(name="key", help="API keys: make one, list them, revoke one.")

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, option: str = "--expires") -> float:
    """ "30d", "12h", "90m", "3600s" or "3600" as seconds.

    Raises:
        CtlError: not a duration.
    """
    m = _DURATION.fullmatch(text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise CtlError(f"{option} {text!r}: give a duration like 30d, 12h, 90m or 3600s")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


@cyclopts.Parameter(name="*")
@dataclass
class LimitOptions:
    """A tenant's limits, or a key's own within its tenant's. Each holds across every
    router at once (each spends leases of it from the control plane).

    Parameters
    ----------
    rpm
        Requests per minute (tenant set: 0 removes the limit).
    tpm
        Tokens (prompt and completion) per minute: a request reserves its prompt and
        max_tokens, and settles on what it used (tenant set: 0 removes it).
    in_flight
        Requests at once (tenant set: 0 removes it).
    budget_day
        Tokens per calendar day (UTC); past it, requests are refused with
        insufficient_quota until the day ends (tenant set: 0 removes it).
    budget_month
        Tokens per calendar month (UTC), as --budget-day (tenant set: 0 removes it).
    """

    rpm: int | None = None
    tpm: int | None = None
    in_flight: int | None = None
    budget_day: int | None = None
    budget_month: int | None = None


def _limits(given: LimitOptions | None, *, clear: bool) -> dict[str, int | None]:
    """The limits named on the command line (``clear``: 0 stands for none)."""
    said: dict[str, int | None] = {}
    for name, value in vars(given or LimitOptions()).items():
        if value is None:
            continue
        if value < 0 or (value == 0 and not clear):
            raise CtlError(f"--{name.replace('_', '-')} {value}: give a number of at least 1")
        said[name] = value or None
    return said


def _when(wall: float | None) -> str:
    if wall is None:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(wall))


def _limits_text(limits: object) -> str:
    if limits is None:
        return "-"
    fields = getattr(limits, "__struct_fields__", ())
    said = [f"{f}={getattr(limits, f)}" for f in fields if getattr(limits, f) is not None]
    return " ".join(said) or "-"


def render_tenants(tenants: list[TenantView]) -> str:
    if not tenants:
        return "no tenants (llmgw ctl tenant create NAME)"
    rows = [["TENANT", "MODELS", "LIMITS", "KEYS", "CREATED"]]
    for t in tenants:
        live = sum(1 for k in t.keys if not k.expired)
        keys = f"{live}" if live == len(t.keys) else f"{live} (+{len(t.keys) - live} expired)"
        rows.append(
            [t.name, ", ".join(t.models) or "all", _limits_text(t.limits), keys, _when(t.created)]
        )
    return table(rows)


def render_keys(keys: list[KeyView]) -> str:
    if not keys:
        return "no keys"
    rows = [["KEY", "TENANT", "BEGINS", "MODELS", "LIMITS", "EXPIRES"]]
    for k in keys:
        expires = _when(k.expires) + (" (expired)" if k.expired else "")
        rows.append(
            [
                k.name,
                k.tenant,
                k.hint + "...",
                ", ".join(k.models) or "tenant's",
                _limits_text(k.limits),
                expires,
            ]
        )
    return table(rows)


def _counted(t: TenantView) -> str:
    """What each limit counts now, against the limit: "rpm 3/600, budget_day 1200/5000"."""
    if not t.counted:
        return "-"
    return ", ".join(
        f"{kind} {n}/{getattr(t.limits, kind, '?')}" for kind, n in sorted(t.counted.items())
    )


def render_tenant(t: TenantView) -> str:
    head = [
        f"tenant   {t.name}",
        f"models   {', '.join(t.models) or 'every model'}",
        f"limits   {_limits_text(t.limits)}",
        f"counted  {_counted(t)}",
        f"weight   {t.weight:g}",
        f"created  {_when(t.created)}",
        "",
    ]
    return "\n".join(head) + render_keys(t.keys)


# --- tenant ---------------------------------------------------------------------------


@tenant_app.command
def create(
    name: str,
    *,
    models: list[str] | None = None,
    limits: LimitOptions | None = None,
    weight: float = 1.0,
    target: Target | None = None,
    json: bool = False,
) -> int:
    """Create a tenant. Its keys are made with llmgw ctl key create --tenant NAME.

    Parameters
    ----------
    models
        The models its keys may use (repeatable); default: every model.
    weight
        Its turn when a model is full and requests queue (router.queue_timeout_s):
        tenants go in order of their recent tokens over their weight; 2 is twice
        the share of 1.
    json
        Print the API's JSON instead of a table.
    """

    def make() -> None:
        body = {
            "name": name,
            "models": models or [],
            "limits": _limits(limits, clear=False),
            "weight": weight,
        }
        answer = AdminClient(target).request("POST", "/v1/tenants", TenantView, body)
        emit(answer, json, render_tenant)

    return run_command("llmgw ctl tenant create", make)


@tenant_app.command(name="list")
def list_(*, target: Target | None = None, json: bool = False) -> int:
    """List the tenants: their models, limits and keys.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """
    return show(
        "tenant list", target, "/v1/tenants", TenantList, json, lambda v: render_tenants(v.tenants)
    )


@tenant_app.command(name="show")
def show_(name: str, *, target: Target | None = None, json: bool = False) -> int:
    """One tenant: its models, limits, and every key (never the keys themselves).

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """
    return show(
        "tenant show", target, f"/v1/tenants/{quote(name)}", TenantView, json, render_tenant
    )


@tenant_app.command(name="set")
def set_(
    name: str,
    *,
    models: list[str] | None = None,
    limits: LimitOptions | None = None,
    weight: float | None = None,
    target: Target | None = None,
    json: bool = False,
) -> int:
    """Change a tenant's models, limits or weight; what is not named stays. Every router
    holds the new limits within a second.

    Parameters
    ----------
    models
        The models its keys may use from now on (repeatable).
    weight
        Its turn when a model is full, against other tenants' (1: an equal turn).
    json
        Print the API's JSON instead of a table.
    """
    body: dict[str, object] = {}
    if models is not None:
        body["models"] = models
    if weight is not None:
        body["weight"] = weight
    return run_command(
        "llmgw ctl tenant set",
        lambda: _set(name, body, limits, target, json),
    )


def _set(
    name: str,
    body: dict[str, object],
    given: LimitOptions | None,
    target: Target | None,
    json: bool,
) -> None:
    limits = _limits(given, clear=True)
    if limits:
        body["limits"] = limits
    if not body:
        raise CtlError(
            "nothing to change: name --models, --weight, --rpm, --tpm, --in-flight, "
            "--budget-day or --budget-month"
        )
    answer = AdminClient(target).request("PATCH", f"/v1/tenants/{quote(name)}", TenantView, body)
    emit(answer, json, render_tenant)


@tenant_app.command
def delete(name: str, *, target: Target | None = None, json: bool = False) -> int:
    """Delete a tenant; its keys stop working at every router within a second.

    Parameters
    ----------
    json
        Print the API's JSON instead of a line.
    """
    return show(
        "tenant delete",
        target,
        f"/v1/tenants/{quote(name)}",
        TenancyAnswer,
        json,
        lambda v: v.message,
        "DELETE",
    )


# --- key ------------------------------------------------------------------------------


@key_app.command(name="create")
def create_key(
    name: str = "",
    *,
    tenant: str = "",
    expires: str = "",
    models: list[str] | None = None,
    limits: LimitOptions | None = None,
    target: Target | None = None,
    json: bool = False,
) -> int:
    """Make an API key. With --tenant: the control plane keeps its hash and every router
    takes it within a second; the key is printed this once. Without: the lines to add
    to a config's [[router.keys]] (then llmgw ctl reload).

    Parameters
    ----------
    name
        Its name (default with --tenant: the tenant's name and a few letters).
    tenant
        The tenant it belongs to (llmgw ctl tenant create).
    expires
        It stops working after this long: 30d, 12h, 90m, 3600s.
    models
        Limit the key to these models (repeatable); default: its tenant's, or every model.
    json
        Print the API's JSON instead of the key and a line.
    """

    def make() -> None:
        if not tenant:
            if not name or expires or json or _limits(limits, clear=False):
                raise CtlError(
                    "a key of no tenant goes in a config file: name it, and give only "
                    "--models (or give --tenant)"
                )
            _config_key(name, models)
            return
        body: dict[str, object] = {"tenant": tenant, "name": name, "models": models or []}
        if expires:
            body["expires_in_s"] = parse_duration(expires)
        if own := _limits(limits, clear=False):
            body["limits"] = own
        answer = AdminClient(target).request("POST", "/v1/keys", KeyCreated, body)
        emit(answer, json, _created)

    return run_command("llmgw ctl key create", make)


def _created(k: KeyCreated) -> str:
    v = k.view
    return (
        f"key: {k.key}\n\n# key {v.name} of tenant {v.tenant}, expires {_when(v.expires)}: "
        "shown this once (only its hash is kept); every router takes it within a second"
    )


def _config_key(name: str, models: list[str] | None) -> None:
    from llmgw.router.keys import hash_key, new_key

    secret = new_key()
    allowed = ", ".join(f'"{m}"' for m in models or [])
    print(f"key: {secret}")
    print(
        "\n# add to the server's config (the key itself is not stored), then llmgw ctl"
        " reload:\n# every llmgw router that follows the server takes it within moments"
    )
    print(f'[[router.keys]]\nname = "{name}"\nsha256 = "{hash_key(secret)}"\nmodels = [{allowed}]')


@key_app.command(name="list")
def list_keys(*, tenant: str = "", target: Target | None = None, json: bool = False) -> int:
    """List the tenants' keys (names, first letters, expiry; never the keys).

    Parameters
    ----------
    tenant
        Only this tenant's.
    json
        Print the API's JSON instead of a table.
    """
    path = f"/v1/keys?tenant={quote(tenant)}" if tenant else "/v1/keys"
    return show("key list", target, path, KeyList, json, lambda v: render_keys(v.keys))


@key_app.command
def revoke(name: str, *, target: Target | None = None, json: bool = False) -> int:
    """Revoke a tenant's key: every router refuses it within a second.

    Parameters
    ----------
    json
        Print the API's JSON instead of a line.
    """
    return show(
        "key revoke",
        target,
        f"/v1/keys/{quote(name)}",
        TenancyAnswer,
        json,
        lambda v: v.message,
        "DELETE",
    )


# --- usage ----------------------------------------------------------------------------


def usage(
    *, tenant: str = "", since: str = "24h", target: Target | None = None, json: bool = False
) -> int:
    """What tenants used, fleet-wide: requests answered, prompt and completion tokens,
    and requests refused at a limit, per model.

    Parameters
    ----------
    tenant
        Only this tenant's.
    since
        How far back: 90m, 24h, 7d (by the hour within two days, else by the day).
    json
        Print the API's JSON instead of a table.
    """

    def ask() -> None:
        start = time.time() - parse_duration(since, "--since")
        path = f"/v1/usage?since={start:.0f}" + (f"&tenant={quote(tenant)}" if tenant else "")
        emit(AdminClient(target).request("GET", path, UsageList), json, render_usage)

    return run_command("llmgw ctl usage", ask)


def render_usage(u: UsageList) -> str:
    head = f"since {_when(u.since)}"
    if not u.rows:
        return f"{head}: no tenant's key was used"
    rows = [["TENANT", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "REFUSED"]]
    for r in u.rows:
        refused = " ".join(f"{k}={v}" for k, v in sorted(r.refused.items())) or "-"
        rows.append(
            [
                r.tenant,
                r.model or "-",
                str(r.requests),
                str(r.prompt_tokens),
                str(r.completion_tokens),
                refused,
            ]
        )
    return f"{head}\n" + table(rows)
