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
patches are left out of the package and listed in SOURCES when they change
no shipped file (e.g. the lib/ fix of dql_reset(), wherever it sits, or
6.12's net-sysfs patch that shows tun's byte_queue_limits) or come last in
the series; one that changes both a shipped file and the core kernel
anywhere else stops the generation (what it ships may need its core part).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from .common import REPO, LabError, cache_dir, run, say, sha256_file
from .fetch import fetch, upstream_version
from .matrix import MATRIX_FILE, Flavor, Matrix, Source, known_features, load

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
    "drivers/net/tun_vnet.h": "tun_vnet.h",            # 7.3's tun.c includes it; not in 6.12
}
# headers of linux-headers-* that our patched copies replace (checked in Kbuild)
REPLACED_HEADERS = ("linux/ptr_ring.h", "linux/if_tun.h", "uapi/linux/if_tun.h")
# what a module package leaves out of the series
NOT_SHIPPED = ("Documentation/", "tools/", "MAINTAINERS")


@dataclass(frozen=True)
class DkmsSpec:
    name: str
    version: str
    lines: dict[str, Flavor]     # "6.12" -> its series (a pseudo-flavor, never built)
    pregen: tuple[Source, ...]   # pristine sources pre-generated into the package
    # per line: what a package row's guests must show with the package and
    # after its removal (lab/flavors.toml [dkms.features], [dkms.stock_features])
    features: dict[str, tuple[str, ...]]
    stock_features: dict[str, tuple[str, ...]]

    @property
    def flavor(self) -> Flavor:
        """A pseudo-flavor whose source is the first pre-generated one (what
        `make test` fetches up front with the kernel flavors' sources)."""
        fl = next(iter(self.lines.values()))
        return replace(fl, source=self.pregen[0]) if self.pregen else fl

    def series_hash(self) -> str:
        """One hash over every line's series (names the generated tree)."""
        return hashlib.sha256("".join(f"{k}={fl.series_hash()}\n"
                                      for k, fl in sorted(self.lines.items())).encode()).hexdigest()


def spec(mx: Matrix | None = None) -> DkmsSpec:
    mx = mx or load()
    data = tomllib.loads(MATRIX_FILE.read_text()).get("dkms")
    if not data:
        raise LabError(f"{MATRIX_FILE}: no [dkms] table")
    try:
        series = data["series"]
        if not isinstance(series, dict) or not series:
            raise LabError(f"{MATRIX_FILE}: [dkms] series must be a table "
                           '{ "X.Y" = "patches/.../series", ... }')
        lines = {}
        for line, path in series.items():
            if not re.fullmatch(r"[0-9]+\.[0-9]+", line):
                raise LabError(f"{MATRIX_FILE}: [dkms] series: {line!r} is not a kernel "
                               "line X.Y")
            src = mx.sources.get(f"linux-source-{line}")
            if src is None:
                raise LabError(f"{MATRIX_FILE}: [dkms] series {line}: no "
                               f"[sources.\"linux-source-{line}\"]")
            lines[line] = Flavor(name=f"dkms-{line}", description="nodrop-dkms", source=src,
                                 series=(REPO / path).resolve(), fragments=(),
                                 localversion="")
        pregen = []
        for name in data.get("pregenerated", []):
            if name not in mx.sources:
                raise LabError(f"{MATRIX_FILE}: [dkms] pregenerated: unknown source {name!r}; "
                               f"valid: {', '.join(mx.sources)}")
            pregen.append(mx.sources[name])
        feats = {}
        for key in ("features", "stock_features"):
            table = data.get(key, {})
            if set(table) != set(lines):
                raise LabError(f"{MATRIX_FILE}: [dkms.{key}] must name exactly the lines of "
                               f"[dkms] series ({' '.join(sorted(lines))}), has "
                               f"{' '.join(sorted(table)) or 'none'}")
            bad = {f for v in table.values() for f in v} - set(known_features())
            if bad:
                raise LabError(f"{MATRIX_FILE}: [dkms.{key}]: unknown features {sorted(bad)}; "
                               f"known: {' '.join(known_features())}")
            feats[key] = {k: tuple(v) for k, v in table.items()}
        sp = DkmsSpec(name=data["name"], version=str(data["version"]), lines=lines,
                      pregen=tuple(pregen), **feats)
    except KeyError as e:
        raise LabError(f"{MATRIX_FILE}: [dkms]: missing key {e}")
    if not re.fullmatch(r"[0-9][A-Za-z0-9.+~]*", sp.version):
        raise LabError(f"{MATRIX_FILE}: [dkms] version {sp.version!r} is not a Debian "
                       "upstream version")
    return sp


def _sections(patch: Path) -> tuple[str, list[tuple[str, str]]]:
    """(mail header, [(path, the `diff --git` section of that file)])."""
    text = patch.read_text(errors="replace")
    parts = re.split(r"(?m)^(?=diff --git )", text)
    out = []
    for part in parts[1:]:
        m = re.match(r"diff --git a/(\S+) b/(\S+)", part)
        if not m or m.group(1) != m.group(2):
            raise LabError(f"{patch.name}: cannot parse {part.splitlines()[0]!r} (renames and "
                           "copies are not supported in a module package)")
        part = re.split(r"(?m)^-- $", part)[0]       # format-patch's signature, last section
        out.append((m.group(1), part))
    return parts[0], out


def _touched(patch: Path) -> list[str]:
    return sorted({path for path, _ in _sections(patch)[1]})


def out_dir(sp: DkmsSpec) -> Path:
    return cache_dir() / "dkms" / f"{sp.name}-{sp.version}-{sp.series_hash()[:12]}"


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


def _module_series(line: str, fl: Flavor, dest: Path) -> tuple[list[Path], list[Path]]:
    """Write the module-shippable part of fl's series to dest (patches with
    only the SHIP files' sections, `series`, `sha256`); (shipped, left out)."""
    patches = fl.patches()
    if not patches:
        raise LabError(f"{fl.series}: empty series, nothing to package")
    def core(p: Path) -> list[str]:
        return [path for path in _touched(p)
                if path not in SHIP and not path.startswith(NOT_SHIPPED)]
    def ships(p: Path) -> bool:
        return any(path in SHIP for path in _touched(p))
    tail = len(patches)             # patches[tail:] all change core files
    while tail and core(patches[tail - 1]):
        tail -= 1
    left_out = [p for i, p in enumerate(patches)
                if core(p) and (i >= tail or not ships(p))]
    patches = [p for p in patches if p not in left_out]
    for p in patches:
        for path in core(p):
            raise LabError(f"{p.name} changes {path} and a shipped file: a DKMS "
                           f"package can only ship {', '.join(SHIP)} (a change "
                           "elsewhere needs a kernel rebuild; a patch that also "
                           "changes a shipped file can be left out only at the end "
                           "of the series); split the patch, or extend "
                           "lab/nodroplab/dkms.py SHIP if this file can be built "
                           "as part of tun.ko/vhost_net.ko")
    for p in left_out:
        say(f"dkms: {line}: leaving out {p.name} (changes {', '.join(core(p))}: needs a "
            "kernel rebuild)")
    dest.mkdir(parents=True)
    names = []
    for p in patches:
        head, secs = _sections(p)
        kept = [body for path, body in secs if path in SHIP]
        if not kept:
            continue                # documentation or selftests only
        subject = next((ln for ln in head.splitlines() if ln.startswith("Subject:")), "")
        # flat: 7.3's net/0001-... and net-next/0001-... keep their directory
        shipped = str(p.relative_to(fl.series.parent)).replace("/", "_")
        (dest / shipped).write_text(f"{subject}\n(module part of {p.name}: "
                                    f"{', '.join(path for path, _ in secs if path in SHIP)})"
                                    "\n\n" + "".join(kept))
        names.append(shipped)
    (dest / "series").write_text("\n".join(names) + "\n")
    (dest / "sha256").write_text(fl.series_hash() + "\n")
    return patches, left_out


def _values(sp: DkmsSpec) -> dict[str, str]:
    lines = sorted(sp.lines, key=lambda v: tuple(int(x) for x in v.split(".")))
    return {"NAME": sp.name, "VERSION": sp.version, "LINES": " ".join(lines),
            "LINES_TEXT": " and ".join(lines),
            "KERNELS_RE": "^(" + "|".join(re.escape(v) for v in lines) + ")\\.",
            "PREGEN": ", ".join(_pregen_versions(sp)) or "none"}


def _pregen_versions(sp: DkmsSpec) -> list[str]:
    return [upstream_version(fetch(s)) for s in sp.pregen]


def generate(sp: DkmsSpec | None = None) -> Path:
    """Write the DKMS source tree; returns the package dir (src/ inside)."""
    sp = sp or spec()
    base = out_dir(sp)
    if base.exists():
        shutil.rmtree(base)
    pkg = base / f"{sp.name}-dkms-{sp.version}"     # dpkg-buildpackage writes to base
    tmp = base / "tmp"
    src = tmp / "src"
    src.mkdir(parents=True)
    values = _values(sp)
    _copy_templates(PACKAGING / "dkms", src, values)
    lines = ["nodrop-dkms %s: generated by `make dkms` (lab/nodroplab/dkms.py)" % sp.version,
             "At build time, nodrop-prepare takes the pristine files of exactly the",
             "kernel's Linux version (linux-source-X.Y, or pregen/<version>/ below) and",
             "applies series/X.Y/ (the module part of each patch, patch -F0).",
             "files (kernel path -> here): "
             + ", ".join(f"{k} -> {v}" for k, v in SHIP.items())]
    for line, fl in sorted(sp.lines.items()):
        shipped, left_out = _module_series(line, fl, src / "series" / line)
        lines += [f"series {line}: {fl.series.relative_to(REPO)} sha256 {fl.series_hash()}"]
        lines += [f"  {p.name} sha256 {sha256_file(p)}" for p in shipped]
        lines += [f"  left out (needs a kernel rebuild): {p.name}" for p in left_out]
    for s in sp.pregen:
        tree = fetch(s)
        up = upstream_version(tree)
        line = ".".join(up.split(".")[:2])
        if line not in sp.lines:
            raise LabError(f"{MATRIX_FILE}: [dkms] pregenerated {s.name} is Linux {up}: no "
                           f"series for {line} in [dkms] series")
        out = src / "pregen" / up
        say(f"dkms: pre-generating Linux {up} from {s.package} {s.version} + series {line}")
        r = subprocess.run(["sh", str(src / "nodrop-prepare"), "--pregen", str(tree), str(out),
                            f"{s.package} {s.version}"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise LabError(f"dkms: pre-generating {s.package} {s.version}: "
                           + (r.stderr.strip() or f"exit {r.returncode}"))
        lines += [f"pregen/{up}: {s.package} {s.version} (.deb sha256 {s.sha256})"]
        lines += [f"  {v} {sha256_file(out / v)}" for v in SHIP.values() if (out / v).exists()]
    (src / "SOURCES").write_text("\n".join(lines) + "\n")
    tmp.rename(pkg)
    say(f"dkms: source tree {pkg / 'src'}")
    return pkg


def _changelog(sp: DkmsSpec) -> str:
    date = subprocess.run(["date", "-R"], capture_output=True, text=True).stdout.strip()
    series = ", ".join(f"{line} (sha256 {fl.series_hash()[:12]})"
                       for line, fl in sorted(sp.lines.items()))
    pregen = ", ".join(f"{s.package} {s.version}" for s in sp.pregen) or "none"
    return (f"{sp.name}-dkms ({sp.version}) unstable; urgency=medium\n\n"
            f"  * The NODROP series {series}, applied at build time to the\n"
            f"    pristine source of each kernel's exact Linux version; pre-generated\n"
            f"    from {pregen}.\n\n"
            f" -- NODROP kernel <kernel@nodrop.invalid>  {date}\n")


def package(sp: DkmsSpec | None = None) -> Path:
    """Generate, add debian/, dpkg-buildpackage; returns the .deb (in dist/)."""
    sp = sp or spec()
    pkg = generate(sp)
    values = _values(sp)
    _copy_templates(PACKAGING / "debian", pkg / "debian", values)
    _copy_templates(PACKAGING / "extra", pkg / "extra", values)
    (pkg / "debian" / "changelog").write_text(_changelog(sp))
    log = pkg.parent / "build.log"
    say(f"dkms: dpkg-buildpackage (log: {log})")
    r = run(["dpkg-buildpackage", "--build=all", "-us", "-uc"], cwd=pkg, log=log,
            check=False, quiet=True)
    if r.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise LabError("dpkg-buildpackage failed (needs debhelper):"
                       "\n  " + "\n  ".join(tail))
    debs = sorted(pkg.parent.glob(f"{sp.name}-dkms_{sp.version}_all.deb"))
    if not debs:
        raise LabError(f"dpkg-buildpackage did not produce {sp.name}-dkms_{sp.version}_all.deb "
                       f"in {pkg.parent}")
    DIST.mkdir(exist_ok=True)
    for old in DIST.glob(f"{sp.name}-dkms_*_all.deb*"):
        old.unlink()                    # one package in dist/: the current one
    out = DIST / debs[0].name
    shutil.copy2(debs[0], out)
    listing = run(["dpkg-deb", "-c", str(out)], capture=True, quiet=True).stdout
    (DIST / (out.name + ".contents")).write_text(listing)
    say(f"dkms: {out} ({out.stat().st_size // 1024} KiB)")
    return out
