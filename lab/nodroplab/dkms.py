"""`dkms` / `package`: the nodrop-dkms Debian package, generated from the
pristine source + the series (never a hand-kept copy of tun.c).

  make dkms      -> $NODROP_CACHE/dkms/<name>-<version>-<serieshash12>/src
                    (the DKMS source tree: tun.c, net.c, vhost.h, patched
                    headers, Kbuild, Makefile, dkms.conf, SOURCES)
  make package   -> the same, plus debian/ from packaging/debian, built with
                    dpkg-buildpackage (debhelper + dh-dkms); the .deb is
                    copied to dist/ and its path printed.

Inputs ([dkms] in lab/flavors.toml): the kernel source package, the series,
the package version and the exact Debian kernel releases it builds for.
Files the series changes must be ones a module package can ship
(SHIP below); documentation, selftests and MAINTAINERS are left out. A patch
that touches anything else needs a kernel rebuild, not a DKMS package: such
patches are left out of the package when they come last in the series
(nothing shipped depends on them, e.g. 6.12's net-sysfs patch that shows
tun's byte_queue_limits), and listed in SOURCES; anywhere else they stop
the generation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .common import REPO, LabError, cache_dir, run, say, sha256_file
from .fetch import fetch, upstream_version
from .matrix import MATRIX_FILE, Flavor, Matrix, load

PACKAGING = REPO / "packaging"
DIST = REPO / "dist"

# kernel path -> path in the DKMS source tree (flat: one Kbuild for both modules)
SHIP = {
    "drivers/net/tun.c": "tun.c",
    "drivers/vhost/net.c": "net.c",
    "drivers/vhost/vhost.h": "vhost.h",                 # unchanged, not in linux-headers
    "include/linux/ptr_ring.h": "include/linux/ptr_ring.h",
    "include/linux/if_tun.h": "include/linux/if_tun.h",
    "include/uapi/linux/if_tun.h": "include/uapi/linux/if_tun.h",
}
# headers of linux-headers-* that our patched copies replace (checked in Kbuild)
REPLACED_HEADERS = ("linux/ptr_ring.h", "linux/if_tun.h", "uapi/linux/if_tun.h")
# what a module package leaves out of the series
NOT_SHIPPED = ("Documentation/", "tools/", "MAINTAINERS")


@dataclass(frozen=True)
class DkmsSpec:
    name: str
    version: str
    flavor: Flavor             # source + series (a pseudo-flavor, never built)
    kernels: tuple[str, ...]   # exact `uname -r` values


def spec(mx: Matrix | None = None) -> DkmsSpec:
    mx = mx or load()
    data = tomllib.loads(MATRIX_FILE.read_text()).get("dkms")
    if not data:
        raise LabError(f"{MATRIX_FILE}: no [dkms] table")
    try:
        src = mx.sources[data["source"]]
        fl = Flavor(name="dkms", description="nodrop-dkms", source=src,
                    series=(REPO / data["series"]).resolve(), fragments=(),
                    localversion="")
        kernels = tuple(data["kernels"])
        sp = DkmsSpec(name=data["name"], version=str(data["version"]), flavor=fl,
                      kernels=kernels)
    except KeyError as e:
        raise LabError(f"{MATRIX_FILE}: [dkms]: missing key {e}")
    if not re.fullmatch(r"[0-9][A-Za-z0-9.+~]*", sp.version):
        raise LabError(f"{MATRIX_FILE}: [dkms] version {sp.version!r} is not a Debian "
                       "upstream version")
    return sp


def _touched(patch: Path) -> list[str]:
    out = []
    for ln in patch.read_text(errors="replace").splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", ln)
        if m:
            out += [m.group(1), m.group(2)]
    return sorted(set(out))


def out_dir(sp: DkmsSpec) -> Path:
    return cache_dir() / "dkms" / f"{sp.name}-{sp.version}-{sp.flavor.series_hash()[:12]}"


def _subst(text: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        text = text.replace(f"@{k}@", v)
    left = re.findall(r"@[A-Z_]+@", text)
    if left:
        raise LabError(f"packaging template: unknown placeholder(s) {sorted(set(left))}")
    return text


def _copy_templates(src: Path, dst: Path, values: dict[str, str]) -> None:
    for f in sorted(src.rglob("*")):
        rel = Path(_subst(str(f.relative_to(src)), values))
        t = dst / rel
        if f.is_dir():
            t.mkdir(parents=True, exist_ok=True)
            continue
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_text(_subst(f.read_text(), values))
        t.chmod(f.stat().st_mode & 0o777)


def generate(sp: DkmsSpec | None = None) -> Path:
    """Write the DKMS source tree; returns the package dir (src/ inside)."""
    sp = sp or spec()
    fl = sp.flavor
    pristine = fetch(fl.source)
    upstream = upstream_version(pristine)
    for k in sp.kernels:
        if not k.startswith(upstream + "+") and not k.startswith(upstream + "-"):
            raise LabError(f"{MATRIX_FILE}: [dkms] kernel {k} is not a {upstream} release "
                           f"({fl.source.package} {fl.source.version} is {upstream})")
    patches = fl.patches()
    if not patches:
        raise LabError(f"{fl.series}: empty series, nothing to package")
    def core(p: Path) -> list[str]:
        return [path for path in _touched(p)
                if path not in SHIP and not path.startswith(NOT_SHIPPED)]
    left_out = []
    while patches and core(patches[-1]):
        left_out.insert(0, patches.pop())
    for p in patches:
        for path in core(p):
            raise LabError(f"{p.name} changes {path}: a DKMS package can only ship "
                           f"{', '.join(SHIP)} (a change elsewhere needs a kernel "
                           "rebuild; only patches at the end of the series can be left "
                           "out); extend lab/nodroplab/dkms.py SHIP if this file "
                           "can be built as part of tun.ko/vhost_net.ko")
    for p in left_out:
        say(f"dkms: leaving out {p.name} (changes {', '.join(core(p))}: needs a "
            "kernel rebuild)")
    base = out_dir(sp)
    if base.exists():
        shutil.rmtree(base)
    pkg = base / f"{sp.name}-dkms-{sp.version}"     # dpkg-buildpackage writes to base
    tmp = base / "tmp"
    stage = tmp / "kernel"                      # kernel layout, for git apply
    for kpath in SHIP:
        (stage / kpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / kpath, stage / kpath)
    stock = {h: sha256_file(pristine / "include" / h) for h in REPLACED_HEADERS}
    say(f"dkms: applying {len(patches)} patches of {fl.series.relative_to(REPO)} to "
        f"{fl.source.package} {fl.source.version} ({', '.join(SHIP)})")
    include = [f"--include={k}" for k in SHIP]
    for p in patches:
        r = subprocess.run(["git", "apply", "--verbose", *include, str(p)], cwd=stage,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            err = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
            raise LabError(f"dkms: {p.name} does not apply to pristine "
                           f"{fl.source.version}: " + "; ".join(err[:4]))
    src = tmp / "src"
    for kpath, rel in SHIP.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(stage / kpath, src / rel)
    shutil.rmtree(stage)

    series_hash = fl.series_hash()
    kernels = " ".join(sp.kernels)
    values = {
        "NAME": sp.name, "VERSION": sp.version, "UPSTREAM": upstream,
        "KERNELS": kernels,
        "KERNELS_RE": "^(" + "|".join(re.escape(k) for k in sp.kernels) + ")$",
        "SERIES_MAJMIN": ".".join(upstream.split(".")[:2]),
    }
    _copy_templates(PACKAGING / "dkms", src, values)
    mk = ["# generated by lab/nodroplab/dkms.py",
          f"NODROP_UPSTREAM := {upstream}",
          f"NODROP_KERNELS := {kernels}",
          f"NODROP_HEADERS := {' '.join(REPLACED_HEADERS)}"]
    mk += [f"NODROP_STOCK_SHA256_{h} := {s}" for h, s in stock.items()]
    (src / "nodrop.mk").write_text("\n".join(mk) + "\n")
    # Each module is built from a small wrapper that includes the generated
    # file unchanged and adds a modinfo tag (modinfo -F nodrop tun) and a
    # version newer than the stock one: dkms installs a module only if its
    # modinfo version is newer than the kernel's (stock vhost_net: 0.0.1,
    # stock tun: none).
    tag = (f'MODULE_INFO(nodrop, "{sp.name}-dkms {sp.version} series {series_hash[:12]} '
           f'on {fl.source.package} {fl.source.version}");\n')
    head = "// SPDX-License-Identifier: GPL-2.0\n/* generated by lab/nodroplab/dkms.py */\n"
    (src / "tun_nodrop.c").write_text(
        head + '#include "tun.c"\n\n' + tag
        + f'MODULE_VERSION("{sp.name}{sp.version}");\n')
    (src / "vhost_net_nodrop.c").write_text(
        head + "#include <linux/module.h>\n\n"
        "/* net.c's MODULE_VERSION(\"0.0.1\") becomes 0.0.1+<name><version> */\n"
        "#undef MODULE_VERSION\n"
        f'#define MODULE_VERSION(v) MODULE_INFO(version, v "+{sp.name}{sp.version}")\n\n'
        '#include "net.c"\n\n' + tag)
    lines = [f"nodrop-dkms {sp.version}: generated by `make dkms` (lab/nodroplab/dkms.py)",
             f"source: {fl.source.package} {fl.source.version} "
             f"(.deb sha256 {fl.source.sha256}), Linux {upstream}",
             f"series: {fl.series.relative_to(REPO)} sha256 {series_hash}"]
    lines += [f"  {p.name} sha256 {sha256_file(p)}" for p in patches]
    lines += [f"  left out (needs a kernel rebuild): {p.name}" for p in left_out]
    lines += ["files (kernel path -> here, sha256 after the series):"]
    lines += [f"  {k} -> {v} {sha256_file(src / v)}" for k, v in SHIP.items()]
    lines += [f"stock headers replaced (sha256 of {upstream}'s, checked by Kbuild):"]
    lines += [f"  include/{h} {s}" for h, s in stock.items()]
    lines += [f"kernels: {kernels}"]
    (src / "SOURCES").write_text("\n".join(lines) + "\n")

    tmp.rename(pkg)
    say(f"dkms: source tree {pkg / 'src'}")
    return pkg


def _changelog(sp: DkmsSpec, upstream: str) -> str:
    date = subprocess.run(["date", "-R"], capture_output=True, text=True).stdout.strip()
    return (f"{sp.name}-dkms ({sp.version}) unstable; urgency=medium\n\n"
            f"  * Generated from {sp.flavor.source.package} {sp.flavor.source.version} and "
            f"the NODROP series\n    (sha256 {sp.flavor.series_hash()[:12]}) for "
            f"{', '.join(sp.kernels)}.\n\n"
            f" -- NODROP kernel <kernel@nodrop.invalid>  {date}\n")


def package(sp: DkmsSpec | None = None) -> Path:
    """Generate, add debian/, dpkg-buildpackage; returns the .deb (in dist/)."""
    sp = sp or spec()
    pkg = generate(sp)
    upstream = upstream_version(fetch(sp.flavor.source))
    values = {"NAME": sp.name, "VERSION": sp.version, "UPSTREAM": upstream,
              "KERNELS": " ".join(sp.kernels),
              "SERIES_MAJMIN": ".".join(upstream.split(".")[:2])}
    _copy_templates(PACKAGING / "debian", pkg / "debian", values)
    _copy_templates(PACKAGING / "extra", pkg / "extra", values)
    # dh_dkms installs debian/<package>.dkms as /usr/src/<name>-<version>/dkms.conf
    shutil.move(pkg / "src" / "dkms.conf", pkg / "debian" / f"{sp.name}-dkms.dkms")
    (pkg / "debian" / "changelog").write_text(_changelog(sp, upstream))
    log = pkg.parent / "build.log"
    say(f"dkms: dpkg-buildpackage (log: {log})")
    r = run(["dpkg-buildpackage", "--build=all", "-us", "-uc"], cwd=pkg, log=log,
            check=False, quiet=True)
    if r.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise LabError("dpkg-buildpackage failed (needs debhelper and dh-dkms):"
                       "\n  " + "\n  ".join(tail))
    debs = sorted(pkg.parent.glob(f"{sp.name}-dkms_{sp.version}_all.deb"))
    if not debs:
        raise LabError(f"dpkg-buildpackage did not produce {sp.name}-dkms_{sp.version}_all.deb "
                       f"in {pkg.parent}")
    DIST.mkdir(exist_ok=True)
    out = DIST / debs[0].name
    shutil.copy2(debs[0], out)
    listing = run(["dpkg-deb", "-c", str(out)], capture=True, quiet=True).stdout
    (DIST / (out.name + ".contents")).write_text(listing)
    say(f"dkms: {out} ({out.stat().st_size // 1024} KiB)")
    return out
