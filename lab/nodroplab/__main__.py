"""NODROP lab orchestrator: `python3 -m nodroplab <command>` (PYTHONPATH=lab).

Commands: deps, fetch, kernel, run, test, chaos, bench, tools, flavors, kvm,
dkms, package, test-package (docs/dkms.md); package-prepare and prebuild are
test's background helpers (the package rows' preparation, pkgtest.py; the
later rows' kernels, built niced while the first rows' guests run).
Environment: NODROP_CACHE (default ~/.cache/nodrop), NODROP_JOBS (make -j),
NODROP_KVM (auto|0|1), NODROP_TIMEOUT (guest command timeout, s),
NODROP_PYTHON (interpreter for vng and the in-guest pytest).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from . import deps as deps_mod
from .common import LabError, require_root, say
from .fetch import fetch_all
from .kernel import kernel
from .matrix import load
from . import pkgtest
from .rootfs import load_rootfs
from .suite import build_tools, cmd_bench, cmd_chaos, cmd_run, cmd_test
from .vm import kvm_probe


def _flavors(mx, names, default):
    names = names or default
    return [mx.flavor(n) for n in names]          # unknown name -> LabError listing valid ones


def _rootfs(rootfs, name):
    if name not in rootfs:
        raise LabError(f"[matrix] package: unknown root-filesystem flavor {name!r}; "
                       f"valid: {', '.join(rootfs)}", rc=2)
    return rootfs[name]


def dkms_source(mx):
    """The kernel source the package is generated from ([dkms] source)."""
    from .dkms import spec
    return spec(mx).flavor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nodroplab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("deps", help="install missing host packages (apt) and virtme-ng/pytest (pip)")
    p = sub.add_parser("fetch", help="download + extract the pinned source packages")
    p.add_argument("flavors", nargs="*")
    p = sub.add_parser("kernel", help="build (or reuse) a flavor; prints the bzImage path")
    p.add_argument("flavor")
    p.add_argument("--rebuild", action="store_true",
                   help="run make even if the stamp says up to date (incremental)")
    p = sub.add_parser("run", help="boot a flavor and run CMD as root in the guest")
    p.add_argument("flavor")
    p.add_argument("command", nargs=argparse.REMAINDER, help="shell command line")
    p = sub.add_parser("test", help="build, boot and run the guest suite per flavor")
    p.add_argument("flavors", nargs="*")
    p = sub.add_parser("test-package", help="nodrop-dkms end to end on the root-filesystem "
                                            "flavors (debian-12, debian-13; docs/dkms.md)")
    p.add_argument("flavors", nargs="*")
    p = sub.add_parser("chaos", help="build, boot each debug flavor and run the chaos round "
                                     "(DURATION seconds, SEED)")
    p.add_argument("flavors", nargs="*")
    p = sub.add_parser("mutants", help="build each source mutant of the series "
                                       "(tests/mutants/), run the tests that guard it; "
                                       "fails on a survivor")
    p.add_argument("names", nargs="*", help="only these mutants")
    p = sub.add_parser("bench", help="build, boot each flavor, print the kernel matrix "
                                     "(runs bench/run in the guest if it exists)")
    p.add_argument("flavors", nargs="*")
    p = sub.add_parser("fuzz", help="syzkaller on a fuzz flavor for DURATION seconds "
                                    "(docs/fuzz.md); --smoke: fail unless programs ran")
    p.add_argument("flavor")
    p.add_argument("--duration", type=int, required=True)
    p.add_argument("--smoke", action="store_true")
    sub.add_parser("fuzz-prereqs", help="build the pinned syzkaller and the fuzz image")
    p = sub.add_parser("package-prepare", help="(internal) the package rows' preparation: "
                                               ".deb, rootfs, install; see pkgtest.py")
    p.add_argument("out")
    p.add_argument("flavors", nargs="+")
    p = sub.add_parser("prebuild", help="(internal) build these flavors one after "
                                        "another; make test runs it niced ahead of the rows")
    p.add_argument("flavors", nargs="+")
    sub.add_parser("tools", help="make -C tools OUT=<repo>/tools/build")
    sub.add_parser("flavors", help="list the flavors of lab/flavors.toml")
    sub.add_parser("kvm", help="probe whether QEMU can use KVM here")
    sub.add_parser("dkms", help="generate the nodrop-dkms source tree from the pristine "
                                "source + series; prints its path")
    sub.add_parser("package", help="generate and build the nodrop-dkms .deb (dist/); "
                                   "prints its path")
    a = ap.parse_args(argv)

    mx = load()
    rootfs = load_rootfs()
    if a.cmd == "flavors":
        for name, fl in mx.flavors.items():
            print(f"{name:<18} {fl.source.package} {fl.source.version}"
                  f"{'  series ' + str(fl.series) if fl.series else ''}  {fl.description}")
        for name, rf in rootfs.items():
            print(f"{name:<18} rootfs {rf.suite}, linux-image-{rf.kernel} {rf.kernel_version}"
                  f"  {rf.description}")
        return 0
    if a.cmd == "deps":
        deps_mod.deps()
        return 0
    if a.cmd == "kvm":
        ok, why = kvm_probe()
        print(f"kvm: {'yes' if ok else 'no'} ({why})")
        return 0
    if a.cmd == "tools":
        out = build_tools()
        if out:
            print(out)
        return 0
    if a.cmd in ("dkms", "package"):
        from . import dkms as dkms_mod
        require_root()
        deps_mod.ensure_apt(["xz-utils", *deps_mod.PACKAGE_APT])
        sp = dkms_mod.spec(mx)
        print(dkms_mod.generate(sp) / "src" if a.cmd == "dkms" else dkms_mod.package(sp))
        return 0
    if a.cmd == "fetch":
        fls = _flavors(mx, a.flavors, list(mx.flavors))
        require_root()
        deps_mod.ensure_apt(["xz-utils"])
        fetch_all(list({f.source.name: f.source for f in fls}.values()))
        return 0
    if a.cmd == "kernel":
        fl = mx.flavor(a.flavor)
        deps_mod.deps()
        b = kernel(fl, rebuild=a.rebuild)
        print(b.bzimage)
        return 0
    if a.cmd in ("fuzz", "fuzz-prereqs"):
        from . import fuzz as fuzz_mod
        fl = mx.flavor(a.flavor) if a.cmd == "fuzz" else None
        if fl is not None:
            fuzz_mod.check_flavor(fl)
        require_root()
        deps_mod.deps()
        deps_mod.ensure_apt(fuzz_mod.FUZZ_APT)
        if a.cmd == "fuzz-prereqs":
            print(fuzz_mod.syzkaller(fuzz_mod.load_cfg()))
            print(fuzz_mod.image()[0])
            return 0
        if a.duration <= 0:
            raise LabError("fuzz: DURATION must be a positive number of seconds", rc=2)
        fetch_all([fl.source])
        return fuzz_mod.fuzz(kernel(fl), a.duration, smoke=a.smoke)
    if a.cmd == "prebuild":
        failed = 0
        for name in a.flavors:
            try:
                kernel(mx.flavor(name))
            except LabError as e:     # the row's own kernel() reports it
                say(f"prebuild {name}: {e}")
                failed += 1
        return 1 if failed else 0
    if a.cmd == "run":
        fl = mx.flavor(a.flavor)
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not cmd or not " ".join(cmd).strip():
            raise LabError("run: no command given (make run FLAVOR=x CMD='...')", rc=2)
        deps_mod.deps()
        return cmd_run(fl, " ".join(cmd))
    if a.cmd == "package-prepare":
        require_root()
        return pkgtest.prepare_all([rootfs[n] for n in a.flavors], Path(a.out))
    if a.cmd == "test-package" or (a.cmd == "test" and any(n in rootfs for n in a.flavors)):
        names = a.flavors or list(rootfs)
        rfs = [rootfs[n] for n in names if n in rootfs]
        kernel_names = [n for n in names if n not in rootfs]
        if a.cmd == "test-package" and kernel_names:
            raise LabError(f"test-package: unknown root-filesystem flavor(s) "
                           f"{', '.join(kernel_names)}; valid: {', '.join(rootfs)}", rc=2)
        fls = [mx.flavor(n) for n in kernel_names]
        deps_mod.deps()
        fetch_all(list({f.source.name: f.source for f in fls + [dkms_source(mx)]}.values()))
        selection = pkgtest.FULL if a.cmd == "test-package" else pkgtest.QUICK
        return cmd_test(fls, [], package=pkgtest.PackageTests(rfs, selection),
                        model=a.cmd == "test")
    if a.cmd == "test":
        fls = _flavors(mx, a.flavors, mx.test_default)
        # the short chaos round on each tested flavor's debug sibling; the
        # package rows ([matrix] package, quick selection): default run only
        chaos = [mx.flavor(n) for n in dict.fromkeys(f.chaos for f in fls if f.chaos)]
        rfs = [] if a.flavors else [_rootfs(rootfs, n) for n in mx.package_default]
        deps_mod.deps()
        fetch_all(list({f.source.name: f.source
                        for f in fls + chaos + ([dkms_source(mx)] if rfs else [])}.values()))
        return cmd_test(fls, chaos, package=pkgtest.PackageTests(rfs, pkgtest.QUICK))
    if a.cmd == "chaos":
        fls = _flavors(mx, a.flavors, mx.chaos_default)
        deps_mod.deps()
        fetch_all(list({f.source.name: f.source for f in fls}.values()))
        return cmd_chaos(fls)
    if a.cmd == "mutants":
        from .mutants import cmd_mutants
        deps_mod.deps()
        return cmd_mutants(mx, a.names)
    if a.cmd == "bench":
        fls = _flavors(mx, a.flavors, mx.bench_default)
        deps_mod.deps()
        fetch_all(list({f.source.name: f.source for f in fls}.values()))
        return cmd_bench(fls)
    return 2


def _on_term(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGHUP, _on_term)
    try:
        sys.exit(main())
    except LabError as e:
        print(f"lab: error: {e}", file=sys.stderr)
        sys.exit(e.rc)
    except KeyboardInterrupt:
        say("interrupted (QEMU and make stopped)")
        sys.exit(130)
