"""The nodrop-dkms package end to end on Debian's own kernels: `make test`
(quick selection) and `make test-package` (whole files).

Per root-filesystem flavor (lab/nodroplab/rootfs.py: debian-12, debian-13,
debian-12-bpo, debian-13-bpo), in two phases so that the first can overlap
the kernel builds:

  prepare (no lab kernel needed: network, disk, dkms in a chroot; a
  background process of its own, `python -m nodroplab package-prepare`,
  output in <results>/package-prepare.log):
    the .deb (make package); the flavor's kernel resolved from the archive
    (the newest of its line in its pocket); the cached base rootfs
    (debootstrap + apt); a throw-away copy of it; `apt-get install
    ./nodrop-dkms_*.deb` in the chroot as a user would (dkms builds tun +
    vhost_net); host checks: dkms status, modinfo (updates/dkms, made from
    the source of exactly that kernel's version), kernels of other lines
    skipped in one line, a Linux version without its source refused in one
    line. The upgrade journey (upgrade_from) then installs the newer kernel,
    its headers and linux-source as apt upgrade would, and checks that dkms
    built for it from its own source. State in <results>/<flavor>/prepared.json.
  boots (after the kernel flavors' rows): Debian's /boot/vmlinuz-<kernel>
  with that copy as its root (vng --root): tests/package
  (NODROP_EXPECT=package) and the guest selection, in one pytest run;
  `apt-get remove nodrop-dkms` in the chroot (checks: modules gone, stock
  ones resolved); boot again: tests/package (NODROP_EXPECT=stock) and the
  burst test (stock: 975 of 1000 dropped); then, in the chroot, a dkms
  build error, a series that does not apply (or, without linux-source, no
  source of the kernel's version) and missing headers: each one line
  naming the kernel, dpkg --audit clean, the stock modules in place.

Host-side checks are written as junit (junit-host.xml) so they count in the
table like the guest tests.
"""

from __future__ import annotations

import json
import os
import resource
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import replace
import xml.etree.ElementTree as ET
from pathlib import Path

from .common import REPO, TOOLS_OUT, LabChild, LabError, cache_dir, say, tail_lines
from .dkms import spec
from .rootfs import (APT, RootfsFlavor, chroot_sh, ensure_base, resolve, target_release,
                     work_copy)
from .suite import _check_skips, _suite_result, passthrough_env, timeout_s
from .vm import boot_and_run, report_failure

# The guest tests a package run needs (the list), ONE place:
# `make test` runs QUICK, one test per behaviour; `make test-package` FULL,
# the whole files. A node id that no longer exists makes pytest fail
# (exit 4: "not found"), so a renamed test cannot silently drop out.
QUICK = ["test_features.py",                                     # feature detection
         "test_burst.py::test_burst_taildrop[tun]",              # burst, tun
         "test_burst.py::test_burst_taildrop[tap-vnet12]",       # burst, tap + vnet hdr
         "test_concurrent.py::test_concurrent_senders[4-pfifo_fast]",  # concurrent senders
         "test_vhost.py::test_vhost_burst[nobufs-vnethdr]",      # vhost-net consumer
         "test_operator.py::test_counters_burst[privflag-on]",   # operator switch
         "test_operator.py::test_openvpn_unmodified[off-on]"]    # OpenVPN unmodified
FULL = ["test_features.py", "test_burst.py", "test_concurrent.py", "test_vhost.py",
        "test_operator.py"]
# after `apt-get remove`: stock behaviour again (975 of 1000 dropped)
REMOVED = ["test_burst.py::test_burst_taildrop[tun]"]
GUEST_PY = "/usr/bin/python3"        # Debian's python3 + python3-pytest in the rootfs
DEB_IN_ROOT = "/var/tmp"
# Debian's kernel + initramfs + udev coldplug of its modules under TCG: 55-120 s
# at load 5-14 on 2 cores, 295 s once and over 300 s once (the lab's default
# limit) at load 13-14
BOOT_TIMEOUT_S = 900
PREPARED = "prepared.json"
# RootfsFlavor fields resolve() fills in, kept in prepared.json for finish()
RESOLVED = ("kernel", "kernel_version", "start_kernel", "start_version")
PREPARE_LOG = "package-prepare.log"


class Checks:
    """Host-side checks, recorded as one junit testsuite."""

    def __init__(self, suite: str):
        self.suite = suite
        self.cases: list[tuple[str, str | None, float, str]] = []

    def run(self, name: str, fn) -> bool:
        t0 = time.monotonic()
        try:
            out = fn() or ""
            err = None
        except (AssertionError, LabError) as e:
            out, err = "", str(e) or "assertion failed"
        dt = time.monotonic() - t0
        self.cases.append((name, err, dt, out))
        say(f"  check {name}: {'ok' if err is None else 'FAILED: ' + err.splitlines()[0]}")
        return err is None

    def write(self, path: Path) -> None:
        ts = ET.Element("testsuite", name=self.suite, tests=str(len(self.cases)),
                        failures=str(sum(1 for c in self.cases if c[1])))
        for name, err, dt, out in self.cases:
            tc = ET.SubElement(ts, "testcase", classname=self.suite, name=name,
                               time=f"{dt:.2f}")
            if err:
                ET.SubElement(tc, "failure", message=err.splitlines()[0]).text = err
            if out:
                ET.SubElement(tc, "system-out").text = out
        ET.ElementTree(ts).write(path, encoding="unicode")


def _sh(root: Path, script: str, log: Path) -> tuple[int, str]:
    """Run script in the chroot; (exit code, output), appended to log."""
    r = chroot_sh(root, script + " 2>&1", capture=True, check=False, quiet=True)
    out = (r.stdout or "") + (r.stderr or "")
    with open(log, "a") as f:
        f.write(f"$ {script}\n{out}[exit {r.returncode}]\n")
    return r.returncode, out


def _expect(cond: bool, msg: str, out: str = "") -> None:
    if not cond:
        raise AssertionError(msg + (f"\n--- output ---\n{out[-3000:]}" if out else ""))


def _modinfo_origin(root: Path, kver: str, log: Path) -> dict[str, str]:
    got = {}
    for mod in ("tun", "vhost_net"):
        rc, out = _sh(root, f"modinfo -k {shlex.quote(kver)} -F filename {mod}", log)
        got[mod] = out.strip().splitlines()[-1] if out.strip() else f"(exit {rc})"
    return got


def _guest_command(rw: Path, paths: list[str]) -> str:
    """tests/package first, then `paths`, in ONE pytest start-up (each costs
    tens of seconds under TCG on Debian's Python over 9p); -c: tests/guest's
    pytest.ini (junit properties) for both directories."""
    q = shlex.quote
    return "\n".join([
        f"cd {q(str(REPO))}",
        "modprobe tun; modprobe vhost_net; modprobe pktgen 2>/dev/null",
        f"{GUEST_PY} -m pytest -c tests/guest/pytest.ini --rootdir=tests tests/package "
        + " ".join(q(f"tests/guest/{f}") for f in paths)
        + f" -p no:cacheprovider -v --junitxml={q(str(rw / 'junit.xml'))}",
        f"echo $? > {q(str(rw / '.nodrop' / 'rc-guest'))}"])


def _boot(rf: RootfsFlavor, root: Path, rw: Path, paths: list[str], expect: str,
          version: str, features: tuple[str, ...]) -> tuple[dict, object]:
    """One boot of the row's root; features: what the guests must show
    (NODROP_FEATURES), every other skip or xfail fails the row."""
    rw.mkdir(parents=True, exist_ok=True)
    for d in (REPO / "tests", REPO / "tools", rw):      # mount points in the guest root
        (root / str(d).lstrip("/")).mkdir(parents=True, exist_ok=True)
    shares = (f"--rodir={REPO / 'tests'}={REPO / 'tests'}",
              f"--rodir={REPO / 'tools'}={REPO / 'tools'}")
    env = {**passthrough_env(),
           "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8",
           "NODROP_FLAVOR": rf.name, "NODROP_RESULTS": str(rw),
           "NODROP_TOOLS": str(TOOLS_OUT), "NODROP_REPO": str(REPO),
           "NODROP_PYTHON": GUEST_PY, "NODROP_KERNELRELEASE": rf.kernel,
           "NODROP_EXPECT": expect, "NODROP_DKMS_VERSION": version,
           "NODROP_FEATURES": " ".join(features)}
    res = boot_and_run(root / rf.vmlinuz.lstrip("/"), _guest_command(rw, paths),
                       rw, env=env, cwd=REPO, timeout=timeout_s(3600), root=root,
                       shares=shares, boot_timeout=BOOT_TIMEOUT_S, retry_unbooted=True)
    r = _suite_result(rw, "guest", "junit.xml")
    counts = {k: r[k] for k in ("passed", "failed", "skipped")}
    counts["notes"] = []
    _check_skips(features, (), counts, r["details"])
    counts["notes"] = [f"{rw.name}: {n}" for n in r["notes"] + counts["notes"]]
    if res.retried:
        counts["notes"].append(f"{rw.name}: boot retried once: {res.retried}")
    if res.rc is None:
        counts["failed"] = max(counts["failed"], 1)
        counts["notes"].append(f"{rw.name}: " + ("boot failed" if not res.booted
                                                 else "guest died"))
        say(report_failure(res, f"{rf.name} ({rw.name})"))
    return counts, res


# --- phase 1: prepare (no lab kernel needed) --------------------------------------

def _one_line(out: str, kernel: str) -> list[str]:
    """The package's lines about `kernel` ("nodrop-dkms: kernel K: ...")."""
    return [ln for ln in out.splitlines() if ln.startswith(f"nodrop-dkms: kernel {kernel}:")]


def _no_half_configured(root: Path, log: Path) -> None:
    rc, out = _sh(root, "dpkg --audit", log)
    _expect(rc == 0 and not out.strip(), "dpkg --audit: packages left half-configured", out)


def _linux_version(kernel: str, version: str) -> str:
    """Linux X.Y.Z of a Debian kernel: its name says it from 6.12 on
    (6.12.118+deb13-amd64); Debian 12's 6.1 kernels are named by their ABI
    (6.1.0-41-amd64), and the package's version (6.1.192-2) says it."""
    up = version.split(":")[-1].split("-")[0]
    return up if up.startswith(kernel.split(".")[0] + ".") else kernel.split("+")[0].split("-")[0]


def _kernel_line(kernel: str) -> str:
    """The Linux line X.Y of a Debian kernel name (6.1.0-41-amd64 -> 6.1)."""
    return ".".join(re.split(r"[.+-]", kernel)[:2])


def _built_for(root: Path, rf: RootfsFlavor, kernel: str, kversion: str, origin: str,
               log: Path) -> str:
    """dkms installed our modules for kernel (Debian version `kversion`), made
    from `origin`; returns the tag."""
    name, version = spec().name, spec().version
    rc, out = _sh(root, f"dkms status {name}", log)
    _expect(f"{name}/{version}, {kernel}, x86_64: installed" in out,
            f"dkms status does not show {name}/{version} installed for {kernel}", out)
    got = _modinfo_origin(root, kernel, log)
    for mod, fn in got.items():
        _expect(fn.startswith(f"/lib/modules/{kernel}/updates/dkms/{mod}.ko"),
                f"modinfo {mod}: {fn}, expected updates/dkms")
    _, tag = _sh(root, f"modinfo -k {shlex.quote(kernel)} -F {name} tun", log)
    tag = tag.strip()
    up = _linux_version(kernel, kversion)
    _expect(origin in tag and f"Linux {up}" in tag and f"series {rf.line} " in tag,
            f"modinfo -F {name} tun: {tag!r}, expected series {rf.line}, {origin!r}, Linux {up}")
    return tag


def _origin(rf: RootfsFlavor, version: str) -> str:
    """What the modules of a kernel of Debian version `version` must be made from."""
    return f"linux-source-{rf.line} {version}" if rf.linux_source else "(pre-generated)"


def prepare(rf: RootfsFlavor, rw: Path, deb: Path, work: Path) -> None:
    """Resolve the kernel(s), base rootfs, work copy, install the .deb, host
    checks (and the kernel upgrade of a journey); state -> rw/prepared.json."""
    rw.mkdir(parents=True, exist_ok=True)
    sp = spec()
    name, version = sp.name, sp.version
    times: dict[str, float] = {}
    log = rw / "chroot.log"
    checks = Checks(f"{rf.name}.host")
    state = {"flavor": rf.name, "deb": str(deb), "root": str(work), "times": times,
             "error": None, "checks": checks.cases, "built_from": {}}

    def save() -> None:
        (rw / PREPARED).write_text(json.dumps(state, indent=2) + "\n")

    try:
        t0 = time.monotonic()
        rf = resolve(rf)
        times["resolve_kernel"] = round(time.monotonic() - t0, 1)
        state["resolved"] = {k: getattr(rf, k) for k in RESOLVED}
        t0 = time.monotonic()
        base_ok = rf.base.with_name(rf.base.name + ".ok")
        cold = not base_ok.exists()
        ensure_base(rf)
        times["base_rootfs" + ("_cold" if cold else "_cached")] = round(time.monotonic() - t0, 1)
        if cold:
            times.update({f"base_{k}": v for k, v in
                          json.loads(base_ok.read_text()).get("seconds", {}).items()})
        t0 = time.monotonic()
        root = work_copy(rf, work)
        times["work_copy"] = round(time.monotonic() - t0, 1)
    except LabError as e:
        say(f"error: {e}")
        state["error"] = str(e)
        save()
        return
    shutil.copy2(deb, root / DEB_IN_ROOT.lstrip("/") / deb.name)
    in_root = f"{DEB_IN_ROOT}/{deb.name}"
    first, first_version = rf.base_kernel
    # other kernels with headers (build is an absolute symlink into the root)
    others = sorted(p.name for p in (root / "lib/modules").iterdir()
                    if p.name != first and (p / "build").is_symlink())
    state["other_kernel_headers"] = others

    def install():
        t0 = time.monotonic()
        rc, out = _sh(root, f"apt-get install -y -q --no-install-recommends {in_root}", log)
        times["apt_install_deb(dkms build)"] = round(time.monotonic() - t0, 1)
        _expect(rc == 0, f"apt-get install ./{deb.name}: exit {rc}", out)
        for o in others:
            # headers without their image: one line either way, apt never
            # fails; a line the package lacks gets that note, one it has is
            # built or says why not (Debian 12's 6.12 headers next to 6.1)
            has = _kernel_line(o) in sp.lines
            lines = _one_line(out, o)
            _expect(len(lines) == 1 and (has or "no NODROP series" in lines[0]),
                    f"not one line from nodrop-dkms about the other kernel {o}", out)
        _no_half_configured(root, log)
        return out
    checks.run("install_deb", install)

    def installed():
        tag = _built_for(root, rf, first, first_version, _origin(rf, first_version), log)
        state["built_from"][first] = tag
        return tag
    checks.run("dkms_installed_from_exact_source", installed)

    def never_another_version():
        # a Linux version the package has no source for (the next sublevel
        # before Debian publishes its linux-source): refused in one line,
        # never built from another version's tun.c
        fake = f"{rf.line}.999+lab-amd64"
        rc, out = _sh(root, f"cd \"$(mktemp -d)\" && sh /usr/src/{name}-{version}/nodrop-prepare "
                            f"{fake} /lib/modules/{shlex.quote(first)}/build", log)
        _expect(rc != 0, f"nodrop-prepare {fake} succeeded", out)
        lines = _one_line(out, fake)
        _expect(len(lines) == 1 and f"Linux {rf.line}.999 needs its pristine source" in lines[0]
                and f"apt install linux-source-{rf.line}=" in lines[0],
                "no one-line refusal naming the Linux version and linux-source", out)
        return out
    checks.run("never_another_version", never_another_version)

    # a line the package lacks: dkms itself refuses it (BUILD_EXCLUSIVE);
    # Debian 12 and 13 have no such line left (6.1, 6.12, 7.3 all have a series)
    lacking = [o for o in others if _kernel_line(o) not in sp.lines]
    if lacking:
        def other_kernel_dkms():
            o = lacking[0]
            rc, out = _sh(root, f"dkms build -m {name} -v {version} -k {shlex.quote(o)}", log)
            _expect(rc != 0 and "BUILD_EXCLUSIVE" in out,
                    f"dkms build for {o}: expected a BUILD_EXCLUSIVE refusal", out)
            got = _modinfo_origin(root, o, log)
            _expect(all("/updates/" not in v for v in got.values()),
                    f"{o} got our modules: {got}")
            return out
        checks.run("other_kernel_skipped_dkms", other_kernel_dkms)

    if rf.upgrade_from:
        def upgrade():
            # what `apt upgrade` does for a new kernel: image, headers and the
            # (recommended) linux-source of the same version in one transaction;
            # dkms builds in the kernel's postinst hooks (or the linux-source trigger)
            k, v = rf.kernel, rf.kernel_version
            pkgs = [f"linux-image-{k}={v}", f"linux-headers-{k}={v}"]
            if rf.linux_source:
                pkgs.append(f"linux-source-{rf.line}={v}")
            # the cached root's package lists are from the day it was made;
            # the kernel just resolved may be newer (as after `apt update`)
            rc, out = _sh(root, shlex.join([*APT, "update"]), log)
            _expect(rc == 0, f"apt-get update before the upgrade to {k}: exit {rc}", out)
            t0 = time.monotonic()
            rc, out = _sh(root, shlex.join([*APT, *target_release(rf), "install", *pkgs]), log)
            times["apt_install_new_kernel(dkms build)"] = round(time.monotonic() - t0, 1)
            _expect(rc == 0, f"apt-get install of {k}: exit {rc}", out)
            _no_half_configured(root, log)
            _expect(bool(_one_line(out, k)), f"no line from nodrop-dkms about {k}", out)
            tag = _built_for(root, rf, k, v, _origin(rf, v), log)
            state["built_from"][k] = tag
            # the older kernel keeps its modules, built from its own source
            _built_for(root, rf, first, first_version, _origin(rf, first_version), log)
            return out + "\n" + tag
        checks.run(f"upgrade_to_{rf.kernel}", upgrade)
    save()


# --- phase 2: boots, removal, failure paths ----------------------------------------

def finish(rf: RootfsFlavor, rw: Path, selection: list[str]) -> dict:
    """The boot and the checks after it, from rw/prepared.json; one table row."""
    try:
        state = json.loads((rw / PREPARED).read_text())
    except (OSError, ValueError):
        state = {"error": f"preparation did not finish (log: {rw.parent / PREPARE_LOG})"}
    if state.get("resolved"):
        rf = replace(rf, **state["resolved"])
    row = {"flavor": rf.name, "kernel": rf.kernel, "passed": 0, "failed": 0, "skipped": 0,
           "status": "ok", "notes": []}
    sp = spec()
    name, version, pkg = sp.name, sp.version, f"{sp.name}-dkms"
    # the kernels resolved from the archive today: when Debian ships one the
    # series no longer applies to, this names it
    meta = {"flavor": rf.name, "description": rf.description, "suite": rf.suite,
            "line": rf.line, "pocket": rf.pocket, "kernel": rf.kernel,
            "kernel_version": rf.kernel_version,
            "upgrade_from": ({"pocket": rf.upgrade_from, "kernel": rf.start_kernel,
                              "kernel_version": rf.start_version} if rf.upgrade_from else None),
            "linux_source": rf.linux_source, "deb": state.get("deb"),
            "dkms": {"name": name, "version": version,
                     "series_sha256": {k: fl.series_hash() for k, fl in sp.lines.items()},
                     "pregenerated": [f"{s.package} {s.version}" for s in sp.pregen]},
            "built_from": state.get("built_from"),
            "guest_selection": selection, "other_kernel_headers": state.get("other_kernel_headers")}
    if state.get("error"):
        row.update(status="rootfs failed", failed=1, notes=[state["error"].splitlines()[0]])
        (rw / "meta.json").write_text(json.dumps({**meta, "error": state["error"]}, indent=2) + "\n")
        return row
    times = state["times"]
    root = Path(state["root"])
    in_root = f"{DEB_IN_ROOT}/{Path(state['deb']).name}"
    kq = shlex.quote(rf.kernel)
    log = rw / "chroot.log"
    checks = Checks(f"{rf.name}.host")
    checks.cases = [tuple(c) for c in state["checks"]]

    def add(counts: dict) -> None:
        for k in ("passed", "failed", "skipped"):
            row[k] += counts[k]
        row["notes"] += counts["notes"]

    def timed_boot(sub: str, paths: list[str], expect: str) -> None:
        t0 = time.monotonic()
        feats = (sp.features if expect == "package" else sp.stock_features)[rf.line]
        c, res = _boot(rf, root, rw / sub, paths, expect, version, feats)
        times[f"boot+tests_{sub}"] = round(time.monotonic() - t0, 1)
        if res.boot_seconds:
            times[f"boot_to_first_command_{sub}"] = round(res.boot_seconds, 1)
        add(c)

    # boot with the package
    timed_boot("with-package", selection, "package")

    # remove it, as a user would, in the chroot (in a running guest, dkms's
    # depmod over 9p takes minutes and the guest then sees a stale module index)
    def remove():
        rc, out = _sh(root, f"apt-get remove -y -q {pkg}", log)
        _expect(rc == 0, f"apt-get remove {pkg}: exit {rc}", out)
        _, st = _sh(root, f"dkms status {name}", log)
        _expect(not st.strip() or "installed" not in st, f"dkms status after removal: {st}")
        upd = root / f"lib/modules/{rf.kernel}/updates/dkms"
        _expect(not upd.exists() or not list(upd.glob("*.ko*")),
                "modules left in updates/dkms after removal")
        got = _modinfo_origin(root, rf.kernel, log)
        for mod, fn in got.items():
            _expect(fn.startswith(f"/lib/modules/{rf.kernel}/kernel/drivers/"),
                    f"after removal modinfo {mod}: {fn}, expected the stock module")
        return out + json.dumps(got)
    t0 = time.monotonic()
    removed = checks.run("remove_restores_stock", remove)
    times["remove"] = round(time.monotonic() - t0, 1)

    # boot without it: stock behaviour
    if removed:
        timed_boot("removed", REMOVED, "stock")

    # failure paths (chroot only): each must say so in ONE line naming the
    # kernel, leave no package half-configured and the stock modules resolved
    up = _linux_version(rf.kernel, rf.kernel_version)
    src_dir = f"/usr/src/{name}-{version}"

    def stock_stays(what: str) -> None:
        got = _modinfo_origin(root, rf.kernel, log)
        _expect(all("/kernel/drivers/" in v for v in got.values()),
                f"stock modules not in place {what}: {got}")

    def purge() -> None:
        _sh(root, f"dpkg --purge --force-remove-reinstreq {pkg}; "
                  f"dkms remove {name}/{version} --all; rm -rf {src_dir}", log)

    def broken_install(breaks, want, what: str) -> str:
        """Unpack the package, break it (breaks(d), d: its source dir in the
        root), configure it: apt stays clean, the output names rf.kernel in
        one line holding every string want() returns (called after breaks),
        the stock modules stay."""
        d = root / src_dir.lstrip("/")
        rc, out = _sh(root, f"dpkg --unpack {in_root}", log)
        _expect(rc == 0, f"dpkg --unpack: exit {rc}", out)
        breaks(d)
        rc, out = _sh(root, f"dpkg --configure {pkg}", log)
        try:
            _expect(rc == 0, f"dpkg --configure {pkg} failed (exit {rc}): {what} must not "
                             "leave apt half-configured", out)
            _no_half_configured(root, log)
            got = _one_line(out, rf.kernel)
            wanted = want()
            _expect(len(got) == 1 and all(w in got[0] for w in wanted),
                    f"expected one line for {rf.kernel} with {wanted!r}", out)
            stock_stays(what)
        finally:
            purge()
        return out

    def build_failure():
        # a compiler error (what a kernel API change would give)
        def breaks(d: Path) -> None:
            (d / "nodrop-lab-broken.h").write_text("#error nodrop lab: injected build failure\n")
            with open(d / "Kbuild", "a") as f:
                f.write("ccflags-y += -include $(src)/nodrop-lab-broken.h\n")
        return broken_install(breaks, lambda: ("build failed", "make.log"),
                              "after a failed build")

    def series_or_source_missing():
        # a sublevel the series no longer applies to (a context line of its
        # first patch changed), or, without linux-source, no source of the
        # kernel's version (the pre-generated files removed)
        first = ""

        def breaks(d: Path) -> None:
            nonlocal first
            first = (d / "series" / rf.line / "series").read_text().split()[0]
            pf = d / "series" / rf.line / first
            lines = pf.read_text().splitlines(keepends=True)
            i = next(i for i, ln in enumerate(lines) if ln.startswith("@@"))
            j = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(" "))
            lines[j] = " nodrop lab: a context line this Linux version does not have\n"
            pf.write_text("".join(lines))
            shutil.rmtree(d / "pregen", ignore_errors=True)
        if rf.linux_source:
            return broken_install(
                breaks, lambda: (f"patch {first} of the {rf.line} series does not apply "
                                 f"to Linux {up}",),
                "when the series does not apply")
        return broken_install(
            breaks, lambda: (f"Linux {up} needs its pristine source, /usr/src/linux-source-"
                             f"{rf.line}.tar.xz is missing: apt install linux-source-"
                             f"{rf.line}={rf.kernel_version}",), "without the source")

    def missing_headers():
        rc, out = _sh(root, f"apt-get remove -y -q linux-headers-{kq} && "
                            f"apt-get install -y -q --no-install-recommends {in_root}", log)
        _expect(rc == 0, f"install without headers: exit {rc} (must install, not build)", out)
        _no_half_configured(root, log)
        got = _one_line(out, rf.kernel)
        _expect(len(got) == 1 and f"apt install linux-headers-{rf.kernel}" in got[0],
                "no one line naming the headers package", out)
        rc, st = _sh(root, f"dkms status {name} -k {kq}", log)
        _expect(f"{rf.kernel}, x86_64: installed" not in st,
                f"dkms status claims installed for {rf.kernel} without headers: {st}")
        stock_stays("without headers")
        return out
    if removed:
        t0 = time.monotonic()
        checks.run("dkms_build_failure_keeps_stock", build_failure)
        checks.run("series_does_not_apply_keeps_stock" if rf.linux_source
                   else "no_source_keeps_stock", series_or_source_missing)
        checks.run("missing_headers_keeps_stock", missing_headers)
        times["failure_paths"] = round(time.monotonic() - t0, 1)

    checks.write(rw / "junit-host.xml")
    for _, err, _, _ in checks.cases:
        if err:
            row["failed"] += 1
            row["notes"].append("host check failed")
        else:
            row["passed"] += 1
    row["notes"] = sorted(set(row["notes"]))
    if row["failed"]:
        row["status"] = "failed"
    meta.update(times=times, checks=[{"name": n, "ok": e is None} for n, e, _, _ in checks.cases],
                counts={k: row[k] for k in ("passed", "failed", "skipped")})
    (rw / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    say(f"{rf.name}: times {times}")
    return row


def keep_rootfs() -> bool:
    return os.environ.get("NODROP_KEEP_ROOTFS", "") not in ("", "0")


def work_dir(out: Path, rf: RootfsFlavor) -> Path:
    """This run's throw-away copy (per run: runs in other worktrees do not collide)."""
    return cache_dir() / "rootfs" / "work" / f"{out.name}-{rf.name}"


def prepare_all(rfs: list[RootfsFlavor], out: Path) -> int:
    """`package-prepare`: the .deb once, then prepare() per flavor."""
    from .deps import PACKAGE_APT, ensure_apt
    from .dkms import package
    try:
        ensure_apt(PACKAGE_APT)
        deb = package()
    except LabError as e:
        say(f"error: {e}")
        for rf in rfs:
            (out / rf.name).mkdir(parents=True, exist_ok=True)
            (out / rf.name / PREPARED).write_text(json.dumps(
                {"flavor": rf.name, "error": f"make package failed: {e}"}) + "\n")
        return 1
    for rf in rfs:
        t0 = time.monotonic()
        prepare(rf, out / rf.name, deb, work_dir(out, rf))
        say(f"{rf.name}: prepared in {time.monotonic() - t0:.0f}s")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    say(f"preparation CPU time (what it takes from the kernel builds): "
        f"{ru.ru_utime:.0f}s user + {ru.ru_stime:.0f}s sys")
    return 0


class PackageTests:
    """The package rows of a test run: prepare in a background process
    (started first, so it overlaps the kernel builds and their guests),
    boot when rows() is called."""

    def __init__(self, rfs: list[RootfsFlavor], selection: list[str]):
        self.rfs, self.selection = rfs, selection
        self.proc: LabChild | None = None
        self.out: Path | None = None
        self.cleaners: list[subprocess.Popen] = []

    def start(self, out: Path) -> None:
        self.out = out
        if not self.rfs:
            return
        log = out / PREPARE_LOG
        say(f"package tests: preparing {', '.join(rf.name for rf in self.rfs)} in the "
            f"background (log: {log})")
        # niced: it has until the package rows (the kernel rows come first),
        # the first kernel build and the guests have not
        self.proc = LabChild(["package-prepare", str(out), *(rf.name for rf in self.rfs)], log,
                             nice=10)

    def rows(self) -> list[dict]:
        if not self.rfs:
            return []
        t0 = time.monotonic()
        if self.proc.running():
            say("package tests: waiting for the background preparation "
                f"(log: {self.out / PREPARE_LOG})")
        rc = self.proc.wait()
        say(f"package tests: preparation exit {rc} (waited {time.monotonic() - t0:.0f}s)")
        if rc != 0:
            say(f"package tests: last lines of {self.out / PREPARE_LOG}:\n  "
                + "\n  ".join(tail_lines(self.out / PREPARE_LOG, 15)))
        rows = []
        for rf in self.rfs:
            rows.append(finish(rf, self.out / rf.name, self.selection))
            self._remove_copy(rf)       # in the background: 880 MB, minutes under load
        return rows

    def _remove_copy(self, rf: RootfsFlavor) -> None:
        d = work_dir(self.out, rf)
        if d.exists() and not keep_rootfs():
            self.cleaners.append(subprocess.Popen(["rm", "-rf", "--one-file-system", str(d)],
                                                  stdin=subprocess.DEVNULL))

    def stop(self) -> None:
        """Kill the background preparation if still running (interrupted or
        failed run), remove the copies, wait for the removals."""
        if self.proc is not None:
            self.proc.stop()
        if self.out is not None and self.proc is not None:
            for rf in self.rfs:
                if not any(str(work_dir(self.out, rf)) in c.args for c in self.cleaners):
                    self._remove_copy(rf)
        for c in self.cleaners:
            c.wait()
