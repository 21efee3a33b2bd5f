"""What storage a path lives on: local to this node, shared by many, or unknown.

The cluster counts copies of a model to decide where to place replicas and
whether to copy weights. Two mistakes are possible and they cost very
different amounts:

- a filer read as *local* costs one unnecessary copy;
- local storage read as *shared* makes the cluster believe a model is on
  every node that mounts "the same" filesystem when it is on one node.

So a filesystem is ``shared`` only when its type is a network or cluster
filesystem *and* /proc/mounts shows something that identifies it the same way
on every client (``storage_id``); a type that is not on either list below is
``unknown``, never ``shared``. When in doubt, an identity is made narrower
(NFS keeps the server as written, Lustre keeps the MGS NIDs): two nodes that
spell one filer differently count it twice, which is the cheap mistake.

``storage_id`` identifies the filesystem, not the mount: one NFS export seen
from twenty nodes under twenty mount points has one id. Local storage gets a
``local:<device>`` id, which is *not* unique across nodes; local copies are
counted per node anyway.

``classify`` and ``parse_mounts`` are pure; ``read_mounts`` is the only I/O.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import attrs

PROC_MOUNTS = Path("/proc/mounts")

StorageKind = Literal["local", "shared", "unknown"]

# Network and cluster filesystems, by /proc/mounts type. Each maps to the
# prefix of its storage_id; how the rest of the id is made is in _shared_id.
#   nfs, nfs4        server:/export; v3 and v4 mounts of one export are one filer.
#   lustre           mgsnid[,nid][:mgsnid]:/fsname.
#   gpfs             the filesystem device name, the same on every node of a GPFS cluster.
#   beegfs           the device is always "beegfs_nodev"; the client config file and
#                    the mount point are the closest thing to an identity /proc/mounts shows.
#   ceph             kernel CephFS: "name@fsid.fsname=/path" or "mon1,mon2:/path".
#   fuse.ceph-fuse   the device is "ceph-fuse": identified by its mount point, as BeeGFS.
#   cifs, smb3       //server/share, case-insensitive as SMB is.
#   glusterfs        server:/volume (the FUSE client reports "fuse.glusterfs").
#   fuse.sshfs       [user@]host:path: a network filesystem like any other; the user is
#                    kept only for relative paths (a home directory), which depend on it.
#   wekafs, panfs    the device as written.
#   fuse.juicefs     "JuiceFS:<volume name>".
#   fuse.gcsfuse     the bucket name.
_SHARED: dict[str, str] = {
    "nfs": "nfs",
    "nfs4": "nfs",
    "lustre": "lustre",
    "gpfs": "gpfs",
    "beegfs": "beegfs",
    "ceph": "ceph",
    "cephfs": "ceph",
    "fuse.ceph-fuse": "ceph-fuse",
    "cifs": "smb",
    "smb3": "smb",
    "smbfs": "smb",
    "glusterfs": "glusterfs",
    "fuse.glusterfs": "glusterfs",
    "fuse.sshfs": "sshfs",
    "wekafs": "wekafs",
    "panfs": "panfs",
    "fuse.juicefs": "juicefs",
    "fuse.gcsfuse": "gcsfuse",
}

# Filesystems whose bytes are on this node. Disk filesystems; memory (tmpfs,
# ramfs: weights staged in /dev/shm are on this node only); overlay (a
# container's root, whose upper layer is the node's disk); squashfs and
# iso9660 (read-only images mounted on this node: even an image file that
# sits on a filer is mounted per node, and counting it per node is the safe
# side).
_LOCAL: frozenset[str] = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "f2fs",
        "jfs",
        "reiserfs",
        "bcachefs",
        "vfat",
        "exfat",
        "ntfs",
        "ntfs3",
        "fuseblk",  # ntfs-3g and friends on a local block device
        "tmpfs",
        "ramfs",
        "devtmpfs",
        "overlay",
        "squashfs",
        "iso9660",
        "erofs",
    }
)

# Deliberately neither, so "unknown": 9p and virtiofs (a hypervisor host's
# directory: shared by the VMs on one host, not across a cluster); autofs (a
# trigger whose real mount appears on top once something is looked up); gfs2
# and ocfs2 (shared-disk filesystems, but /proc/mounts names them by a block
# device path that two unrelated nodes may spell alike); object-store FUSE
# mounts such as s3fs, rclone, mountpoint-s3 (their device does not say which
# bucket). Anything not listed anywhere is unknown as well.


@attrs.frozen
class Mount:
    device: str
    mountpoint: str
    fstype: str
    options: tuple[str, ...] = ()


@attrs.frozen
class Storage:
    kind: StorageKind
    filesystem: str  # the mount's type as /proc/mounts spells it; "" when no mount matched
    storage_id: str  # the same for one filesystem on every node; "" when unknown
    mountpoint: str


UNKNOWN = Storage(kind="unknown", filesystem="", storage_id="", mountpoint="")

_OCTAL = re.compile(rb"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """Undo the kernel's octal escapes (``\\040`` space, ``\\011`` tab, ``\\012``, ``\\134``).

    Works on bytes so a non-UTF-8 mount point survives the way ``os.fsdecode`` would
    read it.
    """
    if "\\" not in field:
        return field
    raw = os.fsencode(field)
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), raw))


def parse_mounts(text: str) -> list[Mount]:
    """/proc/mounts lines, in order (a later mount on the same point hides an earlier one).

    Lines with fewer than three fields are skipped, not guessed at.
    """
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        options = tuple(_unescape(fields[3]).split(",")) if len(fields) > 3 else ()
        mounts.append(
            Mount(
                device=_unescape(fields[0]),
                mountpoint=_unescape(fields[1]),
                fstype=_unescape(fields[2]),
                options=options,
            )
        )
    return mounts


def read_mounts(path: Path = PROC_MOUNTS) -> list[Mount]:
    """The node's mounts; an unreadable table is an empty one (every path then ``unknown``)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return []
    return parse_mounts(os.fsdecode(raw))


def _under(path: str, mountpoint: str) -> bool:
    if mountpoint == "/":
        return path.startswith("/")
    mp = mountpoint.rstrip("/")
    return path == mp or path.startswith(mp + "/")


def find_mount(path: str, mounts: Sequence[Mount]) -> Mount | None:
    """The mount that holds ``path`` (already absolute and resolved): the longest
    mount point that is a whole-component prefix; on a tie the later line, which
    is the one mounted on top."""
    best: Mount | None = None
    best_len = -1
    for m in mounts:
        if not m.mountpoint.startswith("/") or not _under(path, m.mountpoint):
            continue
        length = len(m.mountpoint.rstrip("/"))
        if length >= best_len:
            best, best_len = m, length
    return best


def classify(path: Path, mounts: Sequence[Mount]) -> Storage:
    """Which storage holds ``path``: resolved first (symlinks followed, so a link
    into a filer is the filer), then matched to the longest mount point."""
    resolved = os.path.realpath(os.path.abspath(path))
    mount = find_mount(resolved, mounts)
    if mount is None:
        return UNKNOWN
    return classify_mount(mount)


def classify_mount(mount: Mount) -> Storage:
    fstype = mount.fstype.lower()
    if fstype in _SHARED:
        sid = _shared_id(_SHARED[fstype], mount)
        if sid:
            return Storage("shared", mount.fstype, sid, mount.mountpoint)
        # A network filesystem we cannot tell apart from others: not shared.
        return Storage("unknown", mount.fstype, "", mount.mountpoint)
    if fstype in _LOCAL:
        return Storage("local", mount.fstype, f"local:{mount.device}", mount.mountpoint)
    return Storage("unknown", mount.fstype, "", mount.mountpoint)


def _option(mount: Mount, name: str) -> str:
    prefix = name + "="
    for opt in mount.options:
        if opt.startswith(prefix):
            return opt[len(prefix) :]
    return ""


def _clean_path(p: str) -> str:
    """Collapse repeated slashes and drop a trailing one ("/export/models/" is "/export/models")."""
    p = re.sub(r"/{2,}", "/", p)
    if len(p) > 1:
        p = p.rstrip("/")
    return p


def _host(h: str) -> str:
    return h.strip().lower()


def _shared_id(kind: str, mount: Mount) -> str:
    """The storage_id of a shared filesystem, or "" when /proc/mounts gives nothing to go on."""
    dev = mount.device.strip()
    if kind in ("nfs", "glusterfs", "sshfs"):
        return _host_path_id(kind, dev)
    if kind == "lustre":
        return _lustre_id(dev)
    if kind == "ceph":
        return _ceph_id(mount)
    if kind == "smb":
        # //Server/Share[/sub]: SMB names are case-insensitive; backslashes are Windows spelling.
        d = dev.replace("\\", "/")
        if not d.startswith("//") or len(d) <= 2:
            return ""
        return "smb:" + "//" + _clean_path(d[2:]).lower()
    if kind in ("beegfs", "ceph-fuse"):
        cfg = _option(mount, "cfgFile")
        mp = _clean_path(mount.mountpoint)
        return f"{kind}:{cfg}@{mp}" if cfg else f"{kind}:{mp}"
    if kind == "juicefs":
        return f"juicefs:{dev}" if dev.lower().startswith("juicefs:") and len(dev) > 8 else ""
    # gpfs, wekafs, panfs, gcsfuse: the device (fs name, bucket) as written.
    if not dev or dev in ("none", kind):
        return ""
    return f"{kind}:{dev}"


def _host_path_id(kind: str, dev: str) -> str:
    """``host:/path`` (NFS, GlusterFS, sshfs): host lower-cased, path without a trailing slash."""
    if dev.startswith("["):  # [ipv6]:/export
        end = dev.find("]")
        if end < 0 or dev[end + 1 : end + 2] != ":":
            return ""
        host, path = dev[: end + 1], dev[end + 2 :]
    else:
        host, sep, path = dev.partition(":")
        if not sep:
            return ""
    if kind == "sshfs":
        user, at, bare = host.rpartition("@")
        # A relative path is the user's home directory: the user is part of the identity.
        host = f"{user}@{_host(bare)}" if at and not path.startswith("/") else _host(bare)
    else:
        host = _host(host)
    if not host or (kind != "sshfs" and not path):
        return ""
    return f"{kind}:{host}:{_clean_path(path) if path else path}"


def _lustre_id(dev: str) -> str:
    """``mgsnode[:mgsnode]:/fsname``; each mgsnode is ``nid[,nid]`` (failover).

    The NIDs are kept (sorted, lower-cased): two distinct Lustre filesystems may
    share a name, and merging them is the expensive mistake.
    """
    nids, sep, fsname = dev.rpartition(":/")
    fsname = fsname.strip("/")
    if not sep or not nids or not fsname:
        return ""
    nodes = sorted(",".join(sorted(n.lower() for n in node.split(","))) for node in nids.split(":"))
    return f"lustre:{':'.join(nodes)}:/{fsname}"


def _ceph_id(mount: Mount) -> str:
    """Kernel CephFS. New syntax ``user@fsid.fsname=/path`` (the user does not matter);
    old syntax ``mon[,mon]:/path`` with the filesystem in ``mds_namespace=``/``fs=``."""
    dev = mount.device.strip()
    if "@" in dev and "=" in dev:
        _, _, rest = dev.partition("@")
        cluster, _, path = rest.partition("=")
        if not cluster:
            return ""
        return f"ceph:{cluster.lower()}={_clean_path(path or '/')}"
    mons, sep, path = dev.rpartition(":/")
    if not sep or not mons:
        return ""
    fs = _option(mount, "mds_namespace") or _option(mount, "fs")
    mon_list = ",".join(sorted(m.lower() for m in mons.split(",")))
    suffix = f"#{fs}" if fs else ""
    return f"ceph:{mon_list}:{_clean_path('/' + path)}{suffix}"
