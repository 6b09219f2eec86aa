"""`test-package`: nodrop-dkms end to end on Debian's own kernels.

Per root-filesystem flavor (lab/nodroplab/rootfs.py; debian-12, debian-13):

  1. copy the cached base rootfs (Debian + its linux-image/headers 6.12.117
     + dkms), `apt-get install ./nodrop-dkms_*.deb` in the chroot, as a user
     would; host-side checks: dkms status, modinfo, other kernels skipped,
     unsupported kernel refused with the supported list;
  2. boot Debian's /boot/vmlinuz-<kernel> with that root (vng --root) and run
     tests/package (NODROP_EXPECT=package) and the selected guest suite;
  3. `apt-get remove nodrop-dkms` in the chroot; checks: modules gone, stock
     ones resolved again;
  4. boot again: tests/package (NODROP_EXPECT=stock) and tests/guest/test_burst.py
     (stock: 975 of 1000 dropped);
  5. failure paths in the chroot: a dkms build failure and missing headers
     each fail with a clear message and leave the stock modules in place.

Host-side checks are written as junit (junit-host.xml) so they count in the
table like the guest tests.
"""

from __future__ import annotations

import json
import shlex
import shutil
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .common import REPO, TOOLS_OUT, LabError, cache_dir, say
from .dkms import spec
from .rootfs import APT, RootfsFlavor, _with_debs, chroot, chroot_sh, ensure_base, work_copy
from .suite import _suite_result, passthrough_env, timeout_s
from .vm import boot_and_run, report_failure

# tests/guest files run against the DKMS modules (the selection)
GUEST_SELECTION = ["test_features.py", "test_burst.py", "test_concurrent.py",
                   "test_vhost.py", "test_operator.py"]
GUEST_PY = "/usr/bin/python3"        # Debian's python3 + python3-pytest in the rootfs
DEB_IN_ROOT = "/var/tmp"


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


def _guest_command(rw: Path, expect: str, guest_files: list[str]) -> str:
    q = shlex.quote
    lines = [f"cd {q(str(REPO))}",
             "modprobe tun; modprobe vhost_net; modprobe pktgen 2>/dev/null",
             f"{GUEST_PY} -m pytest tests/package -p no:cacheprovider -v -rA "
             f"--junitxml={q(str(rw / 'junit-package.xml'))}",
             f"echo $? > {q(str(rw / '.nodrop' / 'rc-package'))}"]
    if guest_files:
        files = " ".join(q(f"tests/guest/{f}") for f in guest_files)
        lines += [f"{GUEST_PY} -m pytest {files} -p no:cacheprovider -v "
                  f"--junitxml={q(str(rw / 'junit.xml'))}",
                  f"echo $? > {q(str(rw / '.nodrop' / 'rc-guest'))}"]
    return "\n".join(lines)


def _boot(rf: RootfsFlavor, root: Path, rw: Path, expect: str, guest_files: list[str],
          version: str) -> tuple[dict, object]:
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
           "NODROP_EXPECT": expect, "NODROP_DKMS_VERSION": version}
    res = boot_and_run(root / rf.vmlinuz.lstrip("/"), _guest_command(rw, expect, guest_files),
                       rw, env=env, cwd=REPO, timeout=timeout_s(3600), root=root,
                       shares=shares)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "notes": []}
    suites = [("package", "junit-package.xml")] + ([("guest", "junit.xml")] if guest_files else [])
    for name, junit in suites:
        r = _suite_result(rw, name, junit)
        for k in ("passed", "failed", "skipped"):
            counts[k] += r[k]
        counts["notes"] += [f"{rw.name}: {n}" for n in r["notes"]]
    if res.rc is None:
        counts["failed"] = max(counts["failed"], 1)
        counts["notes"].append(f"{rw.name}: " + ("boot failed" if not res.booted else "guest died"))
        say(report_failure(res, f"{rf.name} ({rw.name})"))
    return counts, res


def package_row(rf: RootfsFlavor, rw: Path, deb: Path) -> dict:
    """Everything for one root-filesystem flavor; one row of the test table."""
    row = {"flavor": rf.name, "kernel": rf.kernel, "passed": 0, "failed": 0, "skipped": 0,
           "status": "ok", "notes": []}
    rw.mkdir(parents=True)
    sp = spec()
    name, version = sp.name, sp.version
    times: dict[str, float] = {}
    log = rw / "chroot.log"
    checks = Checks(f"{rf.name}.host")
    meta = {"flavor": rf.name, "description": rf.description, "kernel": rf.kernel,
            "kernel_version": rf.kernel_version, "suite": rf.suite, "deb": str(deb),
            "dkms": {"name": name, "version": version, "kernels": list(sp.kernels),
                     "series_sha256": sp.flavor.series_hash()}}

    def add(counts: dict) -> None:
        for k in ("passed", "failed", "skipped"):
            row[k] += counts[k]
        row["notes"] += counts["notes"]

    try:
        t0 = time.monotonic()
        base_ok = rf.base.with_name(rf.base.name + ".ok")
        cold = not base_ok.exists()
        ensure_base(rf)
        times["base_rootfs" + ("_cold" if cold else "_cached")] = round(time.monotonic() - t0, 1)
        if cold:
            times.update({f"base_{k}": v for k, v in
                          json.loads(base_ok.read_text()).get("seconds", {}).items()})
        t0 = time.monotonic()
        root = work_copy(rf, cache_dir() / "rootfs" / "work" / rf.name)
        times["work_copy"] = round(time.monotonic() - t0, 1)
    except LabError as e:
        say(f"error: {e}")
        row.update(status="rootfs failed", failed=1, notes=[str(e).splitlines()[0]])
        (rw / "meta.json").write_text(json.dumps({**meta, "error": str(e)}, indent=2) + "\n")
        return row
    shutil.copy2(deb, root / DEB_IN_ROOT.lstrip("/") / deb.name)
    in_root = f"{DEB_IN_ROOT}/{deb.name}"
    kq = shlex.quote(rf.kernel)
    # other kernels with headers (build is an absolute symlink into the root)
    others = sorted(p.name for p in (root / "lib/modules").iterdir()
                    if p.name != rf.kernel and (p / "build").is_symlink())
    meta["other_kernel_headers"] = others

    # 1. install, as a user would
    def install():
        t0 = time.monotonic()
        rc, out = _sh(root, f"apt-get install -y -q --no-install-recommends {in_root}", log)
        times["apt_install_deb(dkms build)"] = round(time.monotonic() - t0, 1)
        _expect(rc == 0, f"apt-get install ./{deb.name}: exit {rc}", out)
        for o in others:
            _expect(f"kernel {o} is not supported" in out,
                    f"no 'not supported' note for the other kernel {o}", out)
        return out
    checks.run("install_deb", install)

    def installed():
        rc, out = _sh(root, f"dkms status {name}", log)
        _expect(f"{name}/{version}, {rf.kernel}, x86_64: installed" in out,
                f"dkms status does not show {name}/{version} installed for {rf.kernel}", out)
        got = _modinfo_origin(root, rf.kernel, log)
        for mod, fn in got.items():
            _expect(fn.startswith(f"/lib/modules/{rf.kernel}/updates/dkms/{mod}.ko"),
                    f"modinfo {mod}: {fn}, expected updates/dkms")
        return out + json.dumps(got)
    checks.run("dkms_installed_updates_dir", installed)

    def unsupported_make():
        bad = rf.kernel.replace(".117", ".118", 1)
        rc, out = _sh(root, f"make -C /usr/src/{name}-{version} KVER={shlex.quote(bad)}", log)
        _expect(rc != 0, f"make KVER={bad} succeeded", out)
        _expect("not supported" in out and all(k in out for k in sp.kernels),
                "no clear 'not supported' message naming the supported kernels", out)
        return out
    checks.run("unsupported_kernel_refused_make", unsupported_make)

    if others:
        def other_kernel_dkms():
            o = others[0]
            rc, out = _sh(root, f"dkms build -m {name} -v {version} -k {shlex.quote(o)}", log)
            _expect(rc != 0 and "BUILD_EXCLUSIVE" in out,
                    f"dkms build for {o}: expected a BUILD_EXCLUSIVE refusal", out)
            got = _modinfo_origin(root, o, log)
            _expect(all("/updates/" not in v for v in got.values()),
                    f"{o} got our modules: {got}")
            return out
        checks.run("other_kernel_skipped_dkms", other_kernel_dkms)

    # 2. boot with the package
    t0 = time.monotonic()
    c, res = _boot(rf, root, rw / "with-package", "package", GUEST_SELECTION, version)
    times["boot+tests_with_package"] = round(time.monotonic() - t0, 1)
    if res.boot_seconds:
        times["boot_to_first_command_with_package"] = round(res.boot_seconds, 1)
    add(c)

    # 3. remove the package
    def remove():
        rc, out = _sh(root, f"apt-get remove -y -q {name}-dkms", log)
        _expect(rc == 0, f"apt-get remove {name}-dkms: exit {rc}", out)
        rc2, st = _sh(root, f"dkms status {name}", log)
        _expect(not st.strip() or "installed" not in st, f"dkms status after removal: {st}")
        _expect(not list((root / f"lib/modules/{rf.kernel}/updates/dkms").glob("*.ko*"))
                if (root / f"lib/modules/{rf.kernel}/updates/dkms").exists() else True,
                "modules left in updates/dkms after removal")
        got = _modinfo_origin(root, rf.kernel, log)
        for mod, fn in got.items():
            _expect(fn.startswith(f"/lib/modules/{rf.kernel}/kernel/drivers/"),
                    f"after removal modinfo {mod}: {fn}, expected the stock module")
        return out + json.dumps(got)
    removed = checks.run("remove_restores_stock", remove)

    # 4. boot without it: stock behaviour
    if removed:
        t0 = time.monotonic()
        c, res = _boot(rf, root, rw / "removed", "stock", ["test_burst.py"], version)
        times["boot+tests_removed"] = round(time.monotonic() - t0, 1)
        add(c)

    # 5. failure paths (chroot only; the stock modules must stay resolved)
    def build_failure():
        rc, out = _sh(root, f"dpkg --unpack {in_root} && "
                            f"echo '#error nodrop lab: injected build failure' "
                            f">> /usr/src/{name}-{version}/tun_nodrop.c && "
                            f"dpkg --configure {name}-dkms", log)
        _expect(rc != 0, "dpkg --configure succeeded with a broken source", out)
        _expect("make.log" in out or "Bad return status" in out,
                "no clear dkms build error (make.log pointer)", out)
        got = _modinfo_origin(root, rf.kernel, log)
        _expect(all("/kernel/drivers/" in v for v in got.values()),
                f"stock modules not in place after a failed build: {got}")
        _sh(root, f"dpkg --purge --force-remove-reinstreq {name}-dkms; "
                  f"dkms remove {name}/{version} --all || true", log)
        return out
    checks.run("dkms_build_failure_keeps_stock", build_failure)

    def missing_headers():
        rc, out = _sh(root, f"apt-get remove -y -q linux-headers-{kq} && "
                            f"apt-get install -y -q --no-install-recommends {in_root}", log)
        _expect(rc == 0, f"install without headers: exit {rc} (must install, not build)", out)
        _expect("headers" in out.lower(), "no message about the missing headers", out)
        rc, st = _sh(root, f"dkms status {name}", log)
        _expect("installed" not in st, f"dkms status claims installed without headers: {st}")
        rc, mk = _sh(root, f"make -C /usr/src/{name}-{version} KVER={kq}", log)
        _expect(rc != 0 and f"apt install linux-headers-{rf.kernel}" in mk,
                "make without headers: no message naming the headers package", mk)
        got = _modinfo_origin(root, rf.kernel, log)
        _expect(all("/kernel/drivers/" in v for v in got.values()),
                f"stock modules not in place without headers: {got}")
        return out + mk
    checks.run("missing_headers_keeps_stock", missing_headers)

    checks.write(rw / "junit-host.xml")
    for _, err, _, _ in checks.cases:
        if err:
            row["failed"] += 1
            row["notes"].append(f"host check failed")
        else:
            row["passed"] += 1
    row["notes"] = sorted(set(row["notes"]))
    if row["failed"]:
        row["status"] = "failed"
    meta.update(times=times, checks=[{"name": n, "ok": e is None} for n, e, _, _ in checks.cases],
                counts={k: row[k] for k in ("passed", "failed", "skipped")})
    (rw / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    say(f"{rf.name}: times {times}")
    if not os_keep():
        shutil.rmtree(root, ignore_errors=True)
    return row


def os_keep() -> bool:
    import os
    return os.environ.get("NODROP_KEEP_ROOTFS", "") not in ("", "0")


def package_rows(rfs: list[RootfsFlavor], out: Path) -> list[dict]:
    """Build the .deb once, then one row per root-filesystem flavor."""
    from .dkms import package
    try:
        deb = package()
    except LabError as e:
        say(f"error: {e}")
        return [{"flavor": rf.name, "kernel": rf.kernel, "passed": 0, "failed": 1,
                 "skipped": 0, "status": "package failed",
                 "notes": [str(e).splitlines()[0]]} for rf in rfs]
    return [package_row(rf, out / rf.name, deb) for rf in rfs]
