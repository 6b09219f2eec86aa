"""`fetch`: download the pinned linux-source .debs and extract them (once).

Cache layout ($NODROP_CACHE, default ~/.cache/nodrop):
  debs/<package>_<version>_all.deb        the downloaded package (sha256-checked)
  src/<package>_<version>/                 its pristine source tree (read-only use)
  src/<package>_<version>.ok               written after a complete extraction
  apt/<suite>/                             private apt state for private_apt sources
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

from .common import LabError, cache_dir, run, safe, say, sha256_file
from .matrix import Source


def src_tree(src: Source) -> Path:
    return cache_dir() / "src" / f"{src.package}_{safe(src.version)}"


def _ok_file(src: Source) -> Path:
    return src_tree(src).with_name(src_tree(src).name + ".ok")


def private_apt_opts(key: str, sources: str) -> list[str]:
    """apt-get/apt-cache options for a private apt state under
    $NODROP_CACHE/apt/<key> with `sources` as its sources.list (the host's
    apt sources and package state are never used or touched)."""
    base = cache_dir() / "apt" / safe(key)
    for d in ("etc/sources.list.d", "etc/preferences.d", "state/lists/partial",
              "cache/archives/partial"):
        (base / d).mkdir(parents=True, exist_ok=True)
    sl = base / "etc" / "sources.list"
    if not sl.exists() or sl.read_text() != sources:
        sl.write_text(sources)
    return [
        "-o", f"Dir::Etc::SourceList={sl}",
        "-o", f"Dir::Etc::SourceParts={base}/etc/sources.list.d",
        "-o", f"Dir::Etc::Preferences={base}/etc/preferences",
        "-o", f"Dir::Etc::PreferencesParts={base}/etc/preferences.d",
        "-o", f"Dir::State={base}/state",
        "-o", f"Dir::State::Lists={base}/state/lists",
        "-o", "Dir::State::status=/dev/null",
        "-o", f"Dir::Cache={base}/cache",
        "-o", "APT::Sandbox::User=root", "-o", "APT::Architecture=amd64",
    ]


def _private_apt_opts(src: Source) -> list[str]:
    return private_apt_opts(src.suite, f"deb [signed-by={src.keyring}] {src.mirror} "
                                       f"{src.suite} {src.components}\n")


def _apt_download(src: Source, dest: Path) -> None:
    opts = ["-o", "APT::Sandbox::User=root", "-q"]
    registry = "Debian registry"
    if src.private_apt:
        opts += _private_apt_opts(src)
        registry = f"Debian registry ({src.mirror} {src.suite}, private apt state)"
    spec = f"{src.package}={src.version}"
    for attempt in (1, 2):
        p = subprocess.run(["apt-get", *opts, "download", spec], cwd=dest,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode == 0:
            return
        if attempt == 1:
            say(f"{spec} not in the apt package lists yet; running apt-get update"
                + (f" (private state for {src.suite})" if src.private_apt else ""))
            u = subprocess.run(["apt-get", *opts, "update"], capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
            if u.returncode != 0:
                err = [ln for ln in (u.stderr + u.stdout).splitlines()
                       if ln.startswith(("E:", "W:", "Err"))]
                say("apt-get update: " + ("; ".join(err[:3]) or f"exit {u.returncode}"))
    err = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.startswith("E:")]
    raise LabError(f"{registry}: cannot download {spec}: "
                   f"{err[0] if err else 'apt-get exit %d' % p.returncode}")


def fetch_deb(src: Source) -> Path:
    debs = cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    deb = debs / src.deb_name
    old = cache_dir() / "src" / src.deb_name          # pre-lab manual layout
    if not deb.exists() and old.exists():
        old.rename(deb)
    if deb.exists() and src.sha256 and sha256_file(deb) != src.sha256:
        say(f"{deb.name}: sha256 mismatch, downloading again")
        deb.unlink()
    if not deb.exists():
        say(f"downloading {src.package} {src.version} ({src.suite})")
        _apt_download(src, debs)
        if not deb.exists():
            raise LabError(f"apt-get download did not produce {deb}")
    if src.sha256:
        got = sha256_file(deb)
        if got != src.sha256:
            deb.unlink()
            raise LabError(f"{src.deb_name}: sha256 {got} != pinned {src.sha256} "
                           "in lab/flavors.toml")
    return deb


def fetch(src: Source) -> Path:
    """Make sure the pristine tree of `src` exists; returns its path."""
    tree, ok = src_tree(src), _ok_file(src)
    if ok.exists() and tree.is_dir():
        return tree
    (cache_dir() / "src").mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another lab process may be fetching
        if ok.exists() and tree.is_dir():
            return tree
        return _fetch_locked(src, tree, ok)


def _fetch_locked(src: Source, tree: Path, ok: Path) -> Path:
    deb = fetch_deb(src)
    listing = run(["dpkg-deb", "-c", str(deb)], capture=True, quiet=True).stdout
    members = [ln.split()[-1] for ln in listing.splitlines()
               if ln.split() and ln.split()[-1].startswith("./usr/src/")
               and ln.split()[-1].endswith(".tar.xz")]
    if len(members) != 1:
        raise LabError(f"{deb.name}: expected one ./usr/src/*.tar.xz, found {members}")
    tmp = tree.with_name(tree.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    say(f"extracting {members[0]} -> {tree}")
    script = ('set -euo pipefail; dpkg-deb --fsys-tarfile "$1" | tar -xOf - "$2" '
              '| xz -dc -T0 | tar -x --no-same-owner --strip-components=1 -C "$3"')
    run(["bash", "-c", script, "extract", str(deb), members[0], str(tmp)], quiet=True)
    if not (tmp / "Makefile").is_file():
        raise LabError(f"{deb.name}: extracted tree has no Makefile")
    if tree.exists():
        shutil.rmtree(tree)
    tmp.rename(tree)
    ok.write_text(sha256_file(deb) + "\n")
    return tree


def upstream_version(tree: Path) -> str:
    """VERSION.PATCHLEVEL.SUBLEVEL from the top Makefile."""
    vals = {}
    for ln in (tree / "Makefile").read_text().splitlines()[:10]:
        k, _, v = ln.partition("=")
        vals[k.strip()] = v.strip()
    return f"{vals['VERSION']}.{vals['PATCHLEVEL']}.{vals['SUBLEVEL']}{vals.get('EXTRAVERSION', '')}"


def fetch_all(sources: list[Source]) -> None:
    for s in sources:
        fetch(s)
