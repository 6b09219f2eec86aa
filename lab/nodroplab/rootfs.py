"""Root-filesystem flavors (`debian-12`, `debian-13`, ...): Debian as a user has it.

A root-filesystem flavor ([rootfs.<name>] in lab/flavors.toml) is a Debian
release and a kernel line of one pocket: `line = "6.12"`, `pocket =
"trixie-security"` means the newest linux-image-6.12.*-amd64 published in
trixie-security. The version is resolved from the archive when the lab
prepares the flavor (resolve(): a private apt state per suite, nothing on
the host), so a row names the kernel Debian ships that day, and recorded in
the row's meta.json. `upgrade_from = "<pocket>"`: the upgrade journey, the
root starts on the newest kernel of that pocket older than the target, and
pkgtest installs the target kernel into it as `apt upgrade` would.

The lab makes, once per resolved kernel, a base root filesystem under
$NODROP_CACHE/rootfs/<name>-<spechash12>/:

  debootstrap --variant=minbase <suite>    (package cache: rootfs/debs/<suite>/)
  sources.list: <suite>, <suite>-updates, <suite>-security (+ -backports)
  apt-get install linux-image-<kernel>=<version> linux-headers-<kernel>=<version>
                  [linux-source-<line>=<version>] dkms + what the guest suite
                  runs (python3, pytest, iproute2, ...)

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
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass, replace
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


# Debian's amd64 flavour: 6.12.118+deb13-amd64; Debian 12's 6.1 kernels are
# named by their ABI instead, 6.1.0-41-amd64 (Linux 6.1.y, y in the version)
KERNEL_RE = r"linux-image-({line}\.[0-9]+(?:\+[a-z0-9]+|-[0-9]+))-amd64"


@dataclass(frozen=True)
class RootfsFlavor:
    name: str
    description: str
    suite: str
    mirror: str
    security_mirror: str
    line: str                   # kernel line, "6.12" / "7.3"
    pocket: str                 # where the target kernel is the newest of its line
    upgrade_from: str | None    # journey: start on the newest older kernel of this pocket
    linux_source: bool          # install linux-source-<line> (the package recommends it)
    packages: tuple[str, ...]   # extra packages of this flavor
    mismatch_headers: str | None  # headers of another kernel, for the mismatch test
    # resolved from the archive by resolve() (placeholders until then)
    kernel: str = ""            # `uname -r` of the target kernel, e.g. 6.12.118+deb13-amd64
    kernel_version: str = ""    # Debian version of linux-image-<kernel>
    start_kernel: str = ""      # journey: the kernel the root starts with
    start_version: str = ""

    @property
    def resolved(self) -> bool:
        return bool(self.kernel_version) and not self.kernel_version.startswith("newest")

    @property
    def base_kernel(self) -> tuple[str, str]:
        """The kernel the base root filesystem is made with."""
        return ((self.start_kernel, self.start_version) if self.upgrade_from
                else (self.kernel, self.kernel_version))

    @property
    def backports(self) -> bool:
        return any(p and p.endswith("-backports") for p in (self.pocket, self.upgrade_from))

    def spec_hash(self) -> str:
        if not self.resolved:
            raise LabError(f"{self.name}: kernel not resolved from the archive yet")
        k, v = self.base_kernel
        h = hashlib.sha256()
        h.update(json.dumps([self.suite, self.mirror, self.security_mirror, k, v,
                             self.line, self.linux_source, self.backports,
                             list(self.packages), GUEST_PACKAGES,
                             self.mismatch_headers, "minbase", 3]).encode())
        return h.hexdigest()

    @property
    def base(self) -> Path:
        return cache_dir() / "rootfs" / f"{self.name}-{self.spec_hash()[:12]}"

    @property
    def vmlinuz(self) -> str:
        return f"/boot/vmlinuz-{self.kernel}"

    def sources_list(self) -> str:
        out = (f"deb {self.mirror} {self.suite} main\n"
               f"deb {self.mirror} {self.suite}-updates main\n"
               f"deb {self.security_mirror} {self.suite}-security main\n")
        if self.backports:
            out += f"deb {self.mirror} {self.suite}-backports main\n"
        return out


def load_rootfs() -> dict[str, RootfsFlavor]:
    data = tomllib.loads(MATRIX_FILE.read_text())
    out = {}
    for name, r in data.get("rootfs", {}).items():
        try:
            line, pocket = str(r["line"]), r["pocket"]
            out[name] = RootfsFlavor(
                name=name, description=r.get("description", ""), suite=r["suite"],
                mirror=r.get("mirror", DEBIAN_MIRROR),
                security_mirror=r.get("security_mirror", "http://deb.debian.org/debian-security"),
                line=line, pocket=pocket, upgrade_from=r.get("upgrade_from"),
                linux_source=bool(r.get("linux_source", True)),
                packages=tuple(r.get("packages", [])),
                mismatch_headers=r.get("mismatch_headers"),
                kernel=f"{line}.y", kernel_version=f"newest in {pocket}")
        except KeyError as e:
            raise LabError(f"{MATRIX_FILE}: rootfs {name}: missing key {e}")
        for p in (pocket, r.get("upgrade_from")):
            if p is not None and not (p == r["suite"] or p.startswith(r["suite"] + "-")):
                raise LabError(f"{MATRIX_FILE}: rootfs {name}: pocket {p!r} is not one of "
                               f"suite {r['suite']!r}'s")
        if not re.fullmatch(r"[0-9]+\.[0-9]+", line):
            raise LabError(f"{MATRIX_FILE}: rootfs {name}: line {line!r} is not X.Y")
    return out


# --- the kernel of a pocket, from the archive ----------------------------------------

def _apt(argv: list[str], opts: list[str], what: str) -> str:
    r = subprocess.run([argv[0], *opts, *argv[1:]], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        err = [ln for ln in (r.stderr + r.stdout).splitlines()
               if ln.startswith(("E:", "W:", "Err"))]
        raise LabError(f"{what}: {' '.join(argv[:2])} failed (exit {r.returncode}; Debian "
                       f"registry): " + ("; ".join(err[:3]) or r.stderr.strip()[-300:]))
    return r.stdout


def _newest(rows: list[tuple[str, str]]) -> tuple[str, str] | None:
    best = None
    for name, ver in rows:
        if best is None or subprocess.run(["dpkg", "--compare-versions", ver, "gt", best[1]]
                                          ).returncode == 0:
            best = (name, ver)
    return best


def resolve(rf: RootfsFlavor) -> RootfsFlavor:
    """rf with its kernel(s) resolved from the archive: the newest
    linux-image-<line>.N+<abi>-amd64 published in rf.pocket (and, for the
    journey, the newest older one in rf.upgrade_from)."""
    if rf.resolved:
        return rf
    from .fetch import private_apt_opts
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    lst = "".join(f"deb [signed-by={keyring}] {ln[4:]}\n"
                  for ln in rf.sources_list().splitlines())
    opts = private_apt_opts(f"rootfs-{rf.suite}{'-bpo' if rf.backports else ''}", lst)
    what = f"{rf.name}: resolving the newest {rf.line} kernel of {rf.pocket}"
    _apt(["apt-get", "-q", "update"], opts, what)
    pat = re.compile(KERNEL_RE.format(line=re.escape(rf.line)))
    names = [n for n in _apt(["apt-cache", "pkgnames", f"linux-image-{rf.line}."], opts,
                             what).split() if pat.fullmatch(n)]
    if not names:
        raise LabError(f"{what}: no linux-image-{rf.line}.*-amd64 in {rf.suite}'s pockets")
    rows: dict[str, list[tuple[str, str]]] = {}
    for ln in _apt(["apt-cache", "madison", *names], opts, what).splitlines():
        parts = [x.strip() for x in ln.split("|")]
        if len(parts) < 3 or not parts[2].endswith(" Packages"):
            continue
        pocket = parts[2].split()[1].split("/")[0]      # "<url> trixie-security/main amd64 Packages"
        rows.setdefault(pocket, []).append((parts[0][len("linux-image-"):], parts[1]))
    target = _newest(rows.get(rf.pocket, []))
    if target is None:
        raise LabError(f"{what}: no linux-image-{rf.line}.*-amd64 in {rf.pocket} (pockets with "
                       f"one: {', '.join(sorted(rows)) or 'none'})")
    out = replace(rf, kernel=target[0], kernel_version=target[1])
    if rf.upgrade_from:
        older = [(k, v) for k, v in rows.get(rf.upgrade_from, [])
                 if subprocess.run(["dpkg", "--compare-versions", v, "lt", target[1]]
                                   ).returncode == 0 and k != target[0]]
        start = _newest(older)
        if start is None:
            raise LabError(f"{rf.name}: no {rf.line} kernel in {rf.upgrade_from} older than "
                           f"{target[0]} {target[1]}: nothing to upgrade from")
        out = replace(out, start_kernel=start[0], start_version=start[1])
    say(f"{rf.name}: {rf.pocket}'s newest {rf.line} kernel is {out.kernel} {out.kernel_version}"
        + (f"; the root starts on {out.start_kernel} {out.start_version} ({rf.upgrade_from})"
           if rf.upgrade_from else ""))
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


def target_release(rf: RootfsFlavor) -> list[str]:
    """A backports kernel is installed as Debian says: apt-get -t <suite>-backports."""
    return ["-t", rf.pocket] if rf.pocket.endswith("-backports") else []


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

    (tmp / "etc/apt/sources.list").write_text(rf.sources_list())
    prc = tmp / "usr/sbin/policy-rc.d"
    prc.write_text(POLICY_RC)
    prc.chmod(0o755)
    # keep downloaded .debs between rebuilds of the base
    (tmp / "etc/apt/apt.conf.d/90nodrop-lab").write_text(
        'APT::Keep-Downloaded-Packages "true";\nAcquire::Retries "3";\n')
    t0 = time.monotonic()
    _with_debs(tmp, debs, ["apt-get", "-q", "update"], log)
    kernel, kver = rf.base_kernel
    pkgs = ["dkms", *GUEST_PACKAGES, *rf.packages]
    if rf.mismatch_headers:
        pkgs.append(rf.mismatch_headers)
    r = _with_debs(tmp, debs, [*APT, "install", *pkgs], log, check=False)
    # the kernel (and the source the package recommends, of its version) in
    # a second step, `-t <suite>-backports` for a backport as Debian says;
    # a -t on the first step would also take backports' openvpn, dkms, ...
    kpkgs = [f"linux-image-{kernel}={kver}", f"linux-headers-{kernel}={kver}"]
    if rf.linux_source:
        kpkgs.append(f"linux-source-{rf.line}={kver}")
    if r.returncode == 0:
        r = _with_debs(tmp, debs, [*APT, *target_release(rf), "install", *kpkgs], log,
                       check=False)
    if r.returncode != 0:
        lines = log.read_text(errors="replace").splitlines()
        err = [ln for ln in lines if ln.startswith(("E:", "W:"))][-4:] or lines[-8:]
        avail = chroot(tmp, ["apt-cache", "madison", f"linux-image-{kernel}"],
                       capture=True, check=False, quiet=True).stdout.strip()
        raise LabError(f"{rf.name}: apt-get install in the chroot failed (Debian registry "
                       f"{rf.mirror}, {rf.pocket}): " + "; ".join(err)
                       + (f"\n  linux-image-{kernel} available: {avail}" if avail
                          else f"\n  no linux-image-{kernel} in {rf.suite}'s pockets")
                       + f"\n  (log: {log})")
    times["apt_install"] = round(time.monotonic() - t0, 1)
    if not (tmp / f"boot/vmlinuz-{kernel}").is_file():
        raise LabError(f"{rf.name}: /boot/vmlinuz-{kernel} missing after installing "
                       f"linux-image-{kernel}")
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
