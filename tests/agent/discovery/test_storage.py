"""Storage classification from /proc/mounts: local, shared (with an id that is
the same from every node), or unknown, and never shared by mistake."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery.storage import (
    _SHARED,
    UNKNOWN,
    Mount,
    Storage,
    classify,
    classify_mount,
    find_mount,
    parse_mounts,
    read_mounts,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mounts"


def mounts(name: str) -> list[Mount]:
    return parse_mounts((FIXTURES / name).read_text())


def at(path: str, name: str) -> Storage:
    return classify(Path(path), mounts(name))


# --- parsing ----------------------------------------------------------------


def test_h200_fixture_is_the_real_proc_mounts() -> None:
    discovery = (FIXTURES.parent / "nvidia-h200" / "discovery.txt").read_text()
    section = discovery.split("### $ cat /proc/mounts\n", 1)[1].split("### rc=", 1)[0]
    assert (FIXTURES / "h200-local.txt").read_text() == section


def test_parse_h200() -> None:
    ms = mounts("h200-local.txt")
    assert len(ms) == 10
    root = next(m for m in ms if m.mountpoint == "/")
    assert root == Mount(
        device="/dev/vda",
        mountpoint="/",
        fstype="ext4",
        options=("rw", "relatime", "discard", "resv_strict", "resuid=65534", "resgid=65534"),
    )


def test_parse_octal_escapes() -> None:
    ms = mounts("spaces.txt")
    assert [m.mountpoint for m in ms] == [
        "/",
        "/mnt/model store",
        "/mnt/shared models",
        "/mnt/tab\tand\\backslash",
    ]
    assert ms[2].device == "10.0.0.5:/export/shared models"


def test_parse_skips_short_lines() -> None:
    assert parse_mounts("\n\ngarbage\n/dev/sda1 /\n/dev/sda1 / ext4\n") == [
        Mount(device="/dev/sda1", mountpoint="/", fstype="ext4")
    ]


def test_read_mounts(tmp_path: Path) -> None:
    assert read_mounts(tmp_path / "missing") == []
    f = tmp_path / "mounts"
    f.write_bytes((FIXTURES / "spaces.txt").read_bytes())
    assert read_mounts(f) == mounts("spaces.txt")
    # This machine's own table parses, whatever it holds.
    for m in read_mounts():
        assert m.mountpoint


# --- the node in the fixture: everything local ----------------------------


def test_h200_local() -> None:
    assert at("/var/lib/llmgw-weights/llama.gguf", "h200-local.txt") == Storage(
        "local", "ext4", "local:/dev/vda", "/"
    )
    assert at("/usr/local/nvidia/lib64/x.so", "h200-local.txt").filesystem == "squashfs"
    assert at("/usr/local/nvidia/lib64/x.so", "h200-local.txt").kind == "local"
    assert at("/proc/cpuinfo", "h200-local.txt").kind == "unknown"


def test_same_mountpoint_twice_the_later_wins() -> None:
    # /dev/shm is mounted twice in the real table; the later mount is on top
    # (and is the one df reports: 134217728k).
    m = find_mount("/dev/shm/model.gguf", mounts("h200-local.txt"))
    assert m is not None and "size=134217728k" in m.options


# --- NFS ----------------------------------------------------------------------


def test_nfs_shared_with_export_as_id() -> None:
    s = at("/mnt/models/llama-3-8b", "nfs-client.txt")
    assert s == Storage("shared", "nfs4", "nfs:10.0.0.5:/export/models", "/mnt/models")


def test_nfs_over_autofs_the_real_mount_wins() -> None:
    # systemd's autofs trigger and the NFS mount share /mnt/models.
    assert at("/mnt/models", "nfs-client.txt").filesystem == "nfs4"


def test_longest_prefix_and_whole_components() -> None:
    # A local disk mounted inside the NFS mount is local...
    assert at("/mnt/models/local-cache/x.gguf", "nfs-client.txt") == Storage(
        "local", "xfs", "local:/dev/nvme1n1", "/mnt/models/local-cache"
    )
    # ...and /mnt/models-local is not under /mnt/models.
    assert at("/mnt/models-local/x.gguf", "nfs-client.txt").storage_id == "local:/dev/md0"
    # /mnt/models-old is on the root disk, whatever its name starts with:
    # matching by string prefix would call it the filer.
    assert at("/mnt/models-old/x.gguf", "nfs-client.txt").kind == "local"
    assert at("/mnt/modelsx", "nfs-client.txt").kind == "local"
    # Outside every other mount: the root filesystem.
    assert at("/opt/models/x.gguf", "nfs-client.txt").storage_id == "local:/dev/nvme0n1p2"


def test_nfs_id_normalised() -> None:
    # Host lower-cased, trailing slash dropped.
    assert at("/home/alice", "nfs-client.txt").storage_id == "nfs:filer01.example.com:/vol/home"
    assert at("/mnt/v6/m", "nfs-client.txt").storage_id == "nfs:[fd00::5]:/export/ipv6"


def test_one_export_from_two_nodes_is_one_storage() -> None:
    # Node 1 mounts 10.0.0.5:/export/models with NFSv4.2 at /mnt/models; node 2
    # mounts it (spelled with a double and a trailing slash) with NFSv3 at /data/llm.
    one = at("/mnt/models/llama", "nfs-client.txt")
    two = at("/data/llm/llama", "nfs-client-2.txt")
    assert one.kind == two.kind == "shared"
    assert one.mountpoint != two.mountpoint
    assert one.storage_id == two.storage_id == "nfs:10.0.0.5:/export/models"
    assert (
        at("/home/a", "nfs-client.txt").storage_id == at("/home/b", "nfs-client-2.txt").storage_id
    )


def test_different_exports_are_different_storage() -> None:
    assert (
        at("/mnt/models/x", "nfs-client.txt").storage_id
        != at("/home/x", "nfs-client.txt").storage_id
    )


# --- Lustre -------------------------------------------------------------------


def test_lustre_shared() -> None:
    s = at("/lustre/models/llama", "lustre-client.txt")
    assert s.kind == "shared" and s.filesystem == "lustre" and s.mountpoint == "/lustre"
    assert s.storage_id == "lustre:10.0.0.10@o2ib:10.0.0.9@o2ib:/lfs01"
    # A second Lustre filesystem mounted inside the first.
    inner = at("/lustre/scratch/llama", "lustre-client.txt")
    assert inner.storage_id == "lustre:172.16.0.19@tcp,172.16.0.9@tcp:/scratch"
    # Local scratch is local.
    assert at("/tmp/x", "lustre-client.txt").kind == "local"


def test_lustre_same_fs_from_two_nodes() -> None:
    # The other node lists the MGS NIDs in another order, mounts elsewhere.
    assert (
        at("/lustre/models", "lustre-client.txt").storage_id
        == at("/mnt/lfs01/models", "lustre-client-2.txt").storage_id
    )
    assert (
        at("/lustre/scratch/m", "lustre-client.txt").storage_id
        == at("/scratch/m", "lustre-client-2.txt").storage_id
    )


def test_lustre_same_name_other_mgs_is_other_storage() -> None:
    # Two filesystems both named lfs01 behind different MGSs are not one copy.
    assert (
        at("/lustre/models", "lustre-client.txt").storage_id
        != at("/mnt/other-site/models", "lustre-client-2.txt").storage_id
    )


# --- the rest ---------------------------------------------------------------

MIXED = [
    ("/gpfs/gpfs01/models", "shared", "gpfs", "gpfs:gpfs01"),
    (
        "/mnt/beegfs/m",
        "shared",
        "beegfs",
        "beegfs:/etc/beegfs/beegfs-client.conf@/mnt/beegfs",
    ),
    (
        "/mnt/cephfs/m",
        "shared",
        "ceph",
        "ceph:10.0.1.1:6789,10.0.1.2:6789,10.0.1.3:6789:/volumes/_nogroup/models#cephfs",
    ),
    (
        "/mnt/ceph-new/m",
        "shared",
        "ceph",
        "ceph:8a1b2c3d-0000-4000-8000-000000000001.cephfs=/models",
    ),
    ("/mnt/smb/m", "shared", "cifs", "smb://nas01/models"),
    ("/mnt/gluster/m", "shared", "fuse.glusterfs", "glusterfs:gluster1:/models"),
    ("/mnt/sshfs/m", "shared", "fuse.sshfs", "sshfs:storage01:/srv/models"),
    ("/mnt/weka/m", "shared", "wekafs", "wekafs:weka01/models"),
    ("/mnt/jfs/m", "shared", "fuse.juicefs", "juicefs:JuiceFS:models"),
    # Neither local nor shared as far as we can tell:
    ("/mnt/host/m", "unknown", "9p", ""),
    ("/mnt/virtiofs/m", "unknown", "virtiofs", ""),
    ("/mnt/s3/m", "unknown", "fuse.s3fs", ""),
    ("/mnt/gfs2/m", "unknown", "gfs2", ""),
    ("/mnt/newfs/m", "unknown", "weirdfs", ""),
    # Local:
    ("/mnt/nvme/m", "local", "xfs", "local:/dev/nvme2n1"),
    ("/mnt/ext3/m", "local", "ext3", "local:/dev/vdc"),
    ("/dev/shm/m", "local", "tmpfs", "local:shm"),
    ("/opt/models/m", "local", "overlay", "local:overlay"),
]


@pytest.mark.parametrize(("path", "kind", "fstype", "sid"), MIXED)
def test_mixed(path: str, kind: str, fstype: str, sid: str) -> None:
    s = at(path, "hpc-mixed.txt")
    assert (s.kind, s.filesystem, s.storage_id) == (kind, fstype, sid)


def test_ceph_user_does_not_matter() -> None:
    a = Mount("llm@fsid1.cephfs=/models", "/a", "ceph", ())
    b = Mount("admin@FSID1.cephfs=/models/", "/b", "ceph", ())
    assert classify_mount(a).storage_id == classify_mount(b).storage_id


def test_sshfs_relative_path_keeps_the_user() -> None:
    a = classify_mount(Mount("alice@host:", "/a", "fuse.sshfs", ()))
    b = classify_mount(Mount("bob@host:", "/b", "fuse.sshfs", ()))
    assert a.kind == b.kind == "shared"
    assert a.storage_id != b.storage_id


@pytest.mark.parametrize(
    ("device", "fstype"),
    [
        ("none", "nfs"),
        ("filer", "nfs4"),  # no ":/export"
        ("[fd00::5/export", "nfs"),
        ("lfs01", "lustre"),  # no MGS
        (":/lfs01", "lustre"),
        ("server/share", "cifs"),
        ("none", "gpfs"),
        ("juicefs", "fuse.juicefs"),
        ("ceph-mon", "ceph"),
    ],
)
def test_network_fs_without_identity_is_unknown(device: str, fstype: str) -> None:
    s = classify_mount(Mount(device, "/mnt/x", fstype, ()))
    assert s.kind == "unknown"
    assert s.filesystem == fstype
    assert s.storage_id == ""


def test_no_mount_matches() -> None:
    assert classify(Path("/srv/models"), []) == UNKNOWN
    relative_only = [Mount("x", "relative", "nfs", ())]
    assert classify(Path("/srv/models"), relative_only) == UNKNOWN


def test_classify_follows_symlinks(tmp_path: Path) -> None:
    filer = tmp_path / "filer"
    (filer / "llama").mkdir(parents=True)
    link = tmp_path / "weights"
    link.symlink_to(filer)
    ms = [
        Mount("/dev/sda1", "/", "ext4", ()),
        Mount("10.0.0.5:/export", str(filer.resolve()), "nfs4", ()),
    ]
    s = classify(link / "llama", ms)
    assert s.kind == "shared" and s.storage_id == "nfs:10.0.0.5:/export"


@given(
    fstype=st.text(min_size=1, max_size=20).filter(lambda t: t.lower() not in _SHARED),
    device=st.text(max_size=40),
)
def test_only_known_network_filesystems_are_shared(fstype: str, device: str) -> None:
    s = classify_mount(Mount(device, "/mnt/x", fstype, ()))
    assert s.kind != "shared"
    if s.kind == "unknown":
        assert s.storage_id == ""


@given(fstype=st.sampled_from(sorted(_SHARED)), device=st.text(max_size=40))
def test_shared_always_has_an_id(fstype: str, device: str) -> None:
    s = classify_mount(Mount(device, "/mnt/x", fstype, ()))
    assert s.kind in ("shared", "unknown")
    assert (s.kind == "shared") == bool(s.storage_id)


@given(st.text(max_size=300))
def test_parse_mounts_never_raises(text: str) -> None:
    for m in parse_mounts(text):
        assert m.fstype
