"""The tenants store: a change is saved before it holds, a failed save changes nothing,
what routers are told, and the rules on names, models and limits."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import msgspec
import pytest

from llmgw.controlplane import tenants as tenants_mod
from llmgw.controlplane.routing import RoutingPublisher
from llmgw.controlplane.tenants import TenantError, TenantStore, allowed
from llmgw.routing import Limits, RouterKey, hash_key


def test_every_confirmed_change_is_read_back_by_a_new_store(tmp_path: Path) -> None:
    path = tmp_path / "state" / "tenants.json"
    store = TenantStore(path)
    store.create_tenant("acme", ["a", "b"], Limits(rpm=60))
    key, secret = store.create_key("acme", models=["a"], limits=Limits(in_flight=2))
    store.set_tenant("acme", limits=Limits(rpm=120))
    again = TenantStore(path)
    assert again.tenant("acme").limits == Limits(rpm=120)
    [kept] = again.keys("acme")
    assert kept == key and kept.sha256 == hash_key(secret) and secret not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    keys, tenants = again.published()
    assert [(k.name, k.models, k.tenant, k.limits) for k in keys] == [
        (key.name, ["a"], "acme", Limits(in_flight=2))
    ]
    assert [(t.name, t.limits) for t in tenants] == [("acme", Limits(rpm=120))]
    assert again.delete_tenant("acme") == [key.name]
    assert TenantStore(path).tenants() == [] and TenantStore(path).keys() == []


def test_a_save_that_fails_changes_nothing_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tenants.json"
    store = TenantStore(path)
    store.create_tenant("acme", [], Limits())
    before = path.read_bytes()

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tenants_mod, "write_atomic", full)
    with pytest.raises(TenantError) as refused:
        store.create_key("acme")
    assert refused.value.status == 507
    assert "No space left on device (free space on its disk" in str(refused.value)
    assert "nothing changed" in str(refused.value)
    with pytest.raises(TenantError):
        store.set_tenant("acme", limits=Limits(rpm=5))
    assert store.keys() == [] and store.tenant("acme").limits == Limits()
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("tenant", "key", "result"),
    [([], [], []), (["a"], [], ["a"]), ([], ["b"], ["b"]), (["a", "b"], ["b", "c"], ["b"])],
)
def test_a_keys_models_are_its_own_within_its_tenants(
    tenant: list[str], key: list[str], result: list[str]
) -> None:
    assert allowed(tenant, key) == result


def test_changes_that_would_leave_a_key_nothing_are_refused(tmp_path: Path) -> None:
    store = TenantStore(tmp_path / "t.json")
    store.create_tenant("acme", ["a", "b"], Limits())
    with pytest.raises(TenantError, match="may use only a, b, none of c"):
        store.create_key("acme", models=["c"])
    store.create_key("acme", name="only-b", models=["b"])
    with pytest.raises(TenantError, match="keys only-b would be left no model"):
        store.set_tenant("acme", models=["a"])
    with pytest.raises(TenantError, match="limit rpm must be at least 1"):
        store.set_tenant("acme", limits=Limits(rpm=0))
    with pytest.raises(TenantError, match="expiry is in the past"):
        store.create_key("acme", expires=1.0)
    with pytest.raises(TenantError) as exists:
        store.create_key("acme", name="only-b")
    assert exists.value.status == 409


def test_a_file_that_is_not_the_stores_is_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tenants": [{"nom": 1}]}))
    with pytest.raises(TenantError, match=r"not valid .*move it aside"):
        TenantStore(path)


def test_a_router_older_than_tenants_knows_nothing_of_their_keys(tmp_path: Path) -> None:
    """It would take a tenant's key for a plain one (no limits, no expiry): the
    routing carries tenants' keys apart from the config's, where it does not look."""

    class OlderSnapshot(msgspec.Struct):  # what such a router decodes
        version: str = ""
        keys: list[RouterKey] = []

    store = TenantStore(tmp_path / "t.json")
    store.create_tenant("acme", [], Limits(rpm=1))
    store.create_key("acme", expires=4_000_000_000.0)
    routing = RoutingPublisher()
    routing.set_keys([RouterKey(name="cfg", sha256="h")])
    routing.set_tenancy(*store.published())
    older = msgspec.json.decode(routing.body, type=OlderSnapshot)
    assert [k.name for k in older.keys] == ["cfg"]
    assert [k.tenant for k in routing.snapshot.tenant_keys] == ["acme"]
