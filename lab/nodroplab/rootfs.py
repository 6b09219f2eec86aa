"""Root-filesystem flavors (`debian-12`, `debian-13`): Debian as a user has it.

A root-filesystem flavor is a Debian release ([rootfs.<name>] in
lab/flavors.toml) and Debian's own 6.12 kernel package. The lab makes, once,
a base root filesystem under $NODROP_CACHE/rootfs/<name>-<spechash12>/:

  debootstrap --variant=minbase <suite>    (package cache: rootfs/debs/<suite>/)
  sources.list: <suite>, <suite>-updates, <suite>-security
  apt-get install linux-image-<kernel>=<version> linux-headers-<kernel>=<version>
                  dkms + what the guest suite runs (python3, pytest, iproute2, ...)

Every run works on a copy of it (`cp -a --reflink=auto`, udev's driver
autoloading masked: UDEV_DRIVERS_RULE), where apt inside
the chroot installs our .deb exactly as a user would, and the guest boots
Debian's /boot/vmlinuz-<kernel> from that copy with it as its root
(vng --root). The base is never modified after it is complete.

Chroot commands run in a private mount namespace (unshare --mount) with
/proc, /sys and /dev mounted there; nothing stays mounted afterwards, and
services are never started (policy-rc.d).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shlex
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .common import LabError, cache_dir, run, say
from .matrix import MATRIX_FILE

# What the guest suite needs inside the root filesystem (Debian packages):
# pytest and the tools' runtime, ip/tc, ethtool, OpenVPN (unmodified program),
# kmod (modprobe), procps.
GUEST_PACKAGES = ["python3", "python3-pytest", "iproute2", "ethtool", "openvpn",
                  "kmod", "procps", "iputils-ping", "util-linux"]

DEBIAN_MIRROR = "http://deb.debian.org/debian"   # a [rootfs.*] flavor's default mirror

POLICY_RC = "#!/bin/sh\n# nodrop lab: never start services in this chroot\nexit 101\n"


@dataclass(frozen=True)
class RootfsFlavor:
    name: str
    description: str
    suite: str
    mirror: str
    security_mirror: str
    kernel: str                 # `uname -r`, e.g. 6.12.117+deb12-amd64
    kernel_version: str         # Debian version of linux-image-<kernel>
    packages: tuple[str, ...]   # extra packages of this flavor
    mismatch_headers: str | None  # headers of another kernel, for the mismatch test

    def spec_hash(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.suite, self.mirror, self.security_mirror, self.kernel,
                             self.kernel_version, list(self.packages), GUEST_PACKAGES,
                             self.mismatch_headers, "minbase", 1]).encode())
        return h.hexdigest()

    @property
    def base(self) -> Path:
        return cache_dir() / "rootfs" / f"{self.name}-{self.spec_hash()[:12]}"

    @property
    def vmlinuz(self) -> str:
        return f"/boot/vmlinuz-{self.kernel}"


def load_rootfs() -> dict[str, RootfsFlavor]:
    data = tomllib.loads(MATRIX_FILE.read_text())
    out = {}
    for name, r in data.get("rootfs", {}).items():
        try:
            out[name] = RootfsFlavor(
                name=name, description=r.get("description", ""), suite=r["suite"],
                mirror=r.get("mirror", DEBIAN_MIRROR),
                security_mirror=r.get("security_mirror", "http://deb.debian.org/debian-security"),
                kernel=r["kernel"], kernel_version=r["kernel_version"],
                packages=tuple(r.get("packages", [])),
                mismatch_headers=r.get("mismatch_headers"))
        except KeyError as e:
            raise LabError(f"{MATRIX_FILE}: rootfs {name}: missing key {e}")
    return out


# --- chroot ----------------------------------------------------------------------

CHROOT_SH = r"""set -e
R="$1"; shift
mount --make-rprivate /
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount --rbind /dev "$R/dev"
mount -t tmpfs tmpfs "$R/tmp"
exec chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive DEBCONF_NONINTERACTIVE_SEEN=true "$@"
"""


def chroot(root: Path, argv: list[str], *, log: Path | None = None, check: bool = True,
           capture: bool = False, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run argv inside root (own mount namespace; mounts vanish with it)."""
    cmd = ["unshare", "--mount", "--fork", "sh", "-c", CHROOT_SH, "chroot-sh", str(root),
           *argv]
    if not quiet:
        say(f"[{root.name}] $ {shlex.join(argv)}")
    return run(cmd, log=log, check=check, capture=capture, quiet=True)


def chroot_sh(root: Path, script: str, **kw) -> subprocess.CompletedProcess:
    return chroot(root, ["/bin/sh", "-c", script], **kw)


APT = ["apt-get", "-y", "-q", "-o", "Dpkg::Use-Pty=0", "-o", "APT::Color=0",
       "--no-install-recommends"]


# --- base root filesystem --------------------------------------------------------

def ensure_base(rf: RootfsFlavor) -> Path:
    """The cached base rootfs of rf (built on first use); returns its path."""
    base = rf.base
    ok = base.with_name(base.name + ".ok")
    if ok.exists() and base.is_dir():
        return base
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f"{rf.name}.lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if ok.exists() and base.is_dir():
            return base
        times = _build_base(rf, base)
        ok.write_text(json.dumps({"flavor": rf.name, "spec_sha256": rf.spec_hash(),
                                  "seconds": times}, indent=2) + "\n")
    return base


def debootstrap(what: str, suite: str, target: Path, mirror: str, log: Path) -> Path:
    """debootstrap --variant=minbase of suite into target, .debs cached in
    rootfs/debs/<suite> (shared by the rootfs flavors and the fuzz image);
    returns that cache, for _with_debs()."""
    debs = cache_dir() / "rootfs" / "debs" / suite
    debs.mkdir(parents=True, exist_ok=True)
    r = run(["debootstrap", "--variant=minbase", f"--cache-dir={debs}",
             "--keyring=/usr/share/keyrings/debian-archive-keyring.gpg",
             suite, str(target), mirror], log=log, check=False, quiet=True)
    if r.returncode != 0:
        raise LabError(f"{what}: debootstrap {suite} failed (exit {r.returncode}; "
                       f"Debian registry {mirror}); last lines of {log}:\n  "
                       + "\n  ".join(log.read_text(errors="replace").splitlines()[-8:]))
    return debs


def _build_base(rf: RootfsFlavor, base: Path) -> dict:
    if shutil.which("debootstrap") is None:
        raise LabError("debootstrap not found: apt-get install debootstrap (make deps does "
                       "it for the package targets)")
    tmp = base.with_name(base.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    log = base.with_name(base.name + ".log")
    log.write_text("")
    times = {}
    t0 = time.monotonic()
    say(f"{rf.name}: debootstrap {rf.suite} -> {tmp} (log: {log})")
    debs = debootstrap(rf.name, rf.suite, tmp, rf.mirror, log)
    times["debootstrap"] = round(time.monotonic() - t0, 1)

    (tmp / "etc/apt/sources.list").write_text(
        f"deb {rf.mirror} {rf.suite} main\n"
        f"deb {rf.mirror} {rf.suite}-updates main\n"
        f"deb {rf.security_mirror} {rf.suite}-security main\n")
    prc = tmp / "usr/sbin/policy-rc.d"
    prc.write_text(POLICY_RC)
    prc.chmod(0o755)
    # keep downloaded .debs between rebuilds of the base
    (tmp / "etc/apt/apt.conf.d/90nodrop-lab").write_text(
        'APT::Keep-Downloaded-Packages "true";\nAcquire::Retries "3";\n')
    t0 = time.monotonic()
    _with_debs(tmp, debs, ["apt-get", "-q", "update"], log)
    pkgs = [f"linux-image-{rf.kernel}={rf.kernel_version}",
            f"linux-headers-{rf.kernel}={rf.kernel_version}", "dkms",
            *GUEST_PACKAGES, *rf.packages]
    if rf.mismatch_headers:
        pkgs.append(rf.mismatch_headers)
    r = _with_debs(tmp, debs, [*APT, "install", *pkgs], log, check=False)
    if r.returncode != 0:
        lines = log.read_text(errors="replace").splitlines()
        err = [ln for ln in lines if ln.startswith(("E:", "W:"))][-4:] or lines[-8:]
        avail = chroot(tmp, ["apt-cache", "madison", f"linux-image-{rf.kernel}"],
                       capture=True, check=False, quiet=True).stdout.strip()
        raise LabError(f"{rf.name}: apt-get install in the chroot failed (Debian registry "
                       f"{rf.mirror}, {rf.suite}-security): " + "; ".join(err)
                       + (f"\n  linux-image-{rf.kernel} available: {avail}" if avail
                          else f"\n  no linux-image-{rf.kernel} in {rf.suite}/-updates/-security")
                       + f"\n  (log: {log})")
    times["apt_install"] = round(time.monotonic() - t0, 1)
    if not (tmp / rf.vmlinuz.lstrip("/")).is_file():
        raise LabError(f"{rf.name}: {rf.vmlinuz} missing after installing "
                       f"linux-image-{rf.kernel}")
    # the guest runs as root from this tree; vng needs mount points for its shares
    chroot(tmp, ["apt-get", "clean"], log=log, quiet=True)
    tmp.rename(base)
    say(f"{rf.name}: base root filesystem ready ({times})")
    return times


def _with_debs(root: Path, debs: Path, argv: list[str], log: Path, check: bool = True):
    """apt inside root with the shared .deb cache bind-mounted on its archives."""
    script = ('mount --bind "$1" "$2/var/cache/apt/archives" && shift 2 && exec "$@"')
    arch = root / "var/cache/apt/archives"
    arch.mkdir(parents=True, exist_ok=True)
    cmd = ["unshare", "--mount", "--fork", "sh", "-c",
           script + "", "sh", str(debs), str(root),
           "unshare", "--mount", "--fork", "sh", "-c", CHROOT_SH, "chroot-sh", str(root),
           *argv]
    say(f"[{root.name}] $ {shlex.join(argv)}")
    r = run(cmd, log=log, check=False, quiet=True)
    if check and r.returncode != 0:
        raise LabError(f"{root.name}: {shlex.join(argv)} failed (exit {r.returncode}); "
                       f"last lines of {log}:\n  "
                       + "\n  ".join(log.read_text(errors="replace").splitlines()[-8:]))
    return r


# udev's rule that loads a driver for every device's modalias. virtme-ng's
# init runs udev coldplug and waits for it to settle; with it, each boot of
# Debian's kernel loaded the drivers of QEMU's emulated hardware (ahci, sr,
# iTCO_wdt, i801_smbus, kvm_amd, ...: 50-70 s of a 120 s boot under TCG,
# docs/lab.md). Nothing the tests use comes from it: tun, vhost_net and
# pktgen are loaded by modprobe in the guest command, /dev/net/tun and
# /dev/vhost-net by the kernel's devtmpfs. A rule file of the same name
# in /etc linked to /dev/null masks it (udev(7)).
UDEV_DRIVERS_RULE = "etc/udev/rules.d/80-drivers.rules"


def work_copy(rf: RootfsFlavor, dest: Path) -> Path:
    """A throw-away copy of the base rootfs at dest, udev's driver
    autoloading masked in it (the base stays as Debian made it)."""
    base = ensure_base(rf)
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    run(["cp", "-a", "--reflink=auto", str(base), str(dest)], quiet=True)
    rule = dest / UDEV_DRIVERS_RULE
    rule.parent.mkdir(parents=True, exist_ok=True)
    rule.symlink_to("/dev/null")
    return dest
