"""`kernel FLAVOR`: build (or reuse) a flavor's bzImage.

* Out of tree: $NODROP_CACHE/build/<flavor>-<sourceversion>-<confighash12>/.
* Patched flavors build from a persistent git tree
  $NODROP_CACHE/trees/<series dir>_<sourceversion>/ (pristine source committed
  once, tag `base`); when the series hash changes: reset to base, clean, and
  `git am` every patch in series order, so only touched files get a new mtime.
* Every make runs in a private mount namespace where the source tree is
  bind-mounted on $NODROP_CACHE/mnt/src and the build dir on
  $NODROP_CACHE/mnt/build: all flavors compile with identical paths, so
  ccache serves identical sources across flavors (stock -> nodrop cold build
  is mostly cache hits) and objects never embed per-flavor paths.
* A stamp (source package+version, config hash, series hash) lets an
  unchanged flavor be reused without running make at all.
* A config change gives the flavor a new build dir; after building it the
  lab keeps the one the flavor used before (a switch back rebuilds only
  what differs) and removes older ones (about 400 MB each).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .common import LabError, cache_dir, jobs, run, safe, say, tail_lines
from .fetch import fetch, upstream_version
from .matrix import Flavor

STAMP = ".nodrop-stamp.json"
CONFIG_STAMP = ".nodrop-config"
GIT_ID = ["-c", "user.name=NODROP lab", "-c", "user.email=lab@nodrop.invalid"]


@dataclass
class Built:
    flavor: Flavor
    bzimage: Path
    build_dir: Path
    kernelrelease: str
    source_tree: Path
    upstream: str
    config_hash: str
    series_hash: str
    patches: list[str]
    reused: bool
    build_seconds: float | None


def build_dir(fl: Flavor) -> Path:
    return cache_dir() / "build" / f"{fl.name}-{safe(fl.source.version)}-{fl.config_hash()[:12]}"


KEEP_OLD_BUILDS = 1  # per flavor and source version, besides the current one


def prune_builds(fl: Flavor) -> None:
    """Remove the flavor's build dirs of older configs but the newest
    KEEP_OLD_BUILDS (by their stamp's mtime; unfinished ones by the dir's).
    Caller holds build_lock(), so no build of them runs; a guest booted
    from one only reads its bzImage, loaded before it runs."""
    cur = build_dir(fl)
    pat = re.compile(re.escape(f"{fl.name}-{safe(fl.source.version)}-") + r"[0-9a-f]{12}")
    old = [d for d in cur.parent.iterdir()
           if d != cur and d.is_dir() and pat.fullmatch(d.name)]

    def age(d: Path) -> float:
        st = d / STAMP
        return (st if st.exists() else d).stat().st_mtime

    for d in sorted(old, key=age, reverse=True)[KEEP_OLD_BUILDS:]:
        say(f"{fl.name}: removing the build of an older config ({d.name})")
        shutil.rmtree(d, ignore_errors=True)


def tree_dir(fl: Flavor) -> Path:
    # One tree per (series, source): flavors that differ only in their config
    # (nodrop-6.12, -debug, -kcsan) share it; builds are serialized by build_lock.
    return cache_dir() / "trees" / f"{fl.series.parent.name}_{safe(fl.source.version)}"


@contextmanager
def build_lock():
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "build.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another lab kernel build is running; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


# --- patched trees ------------------------------------------------------------

def _git(tree: Path, *args: str, capture: bool = True, check: bool = True):
    return run(["git", *GIT_ID, "-C", str(tree), *args], capture=capture, check=check,
               quiet=True)


def _create_tree(fl: Flavor, pristine: Path) -> Path:
    tree = tree_dir(fl)
    tmp = tree.with_name(tree.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    say(f"creating git tree {tree} (pristine {fl.source.package} {fl.source.version}, once)")
    t0 = time.monotonic()
    run(["cp", "-a", str(pristine), str(tmp)], quiet=True)
    _git(tmp, "init", "-q")
    for k, v in (("core.looseCompression", "1"), ("gc.auto", "0"), ("core.autocrlf", "false"),
                 ("user.name", "NODROP lab"), ("user.email", "lab@nodrop.invalid")):
        _git(tmp, "config", k, v)
    _git(tmp, "add", "-A", "-f")
    _git(tmp, "commit", "-q", "--no-verify", "-m",
         f"{fl.source.package} {fl.source.version} (pristine)")
    _git(tmp, "tag", "base")
    tmp.rename(tree)
    say(f"git tree ready in {time.monotonic() - t0:.0f}s")
    return tree


def _am_failure(patch: Path, out: str) -> str:
    keep = [ln for ln in out.splitlines()
            if re.match(r"(error|fatal|warning): |Checking patch |Hunk #|patching file |"
                        r".*\.rej", ln)]
    lines = "\n  ".join(keep[-20:]) or out.strip()[-1500:]
    return f"patch {patch.name} does not apply ({patch}):\n  {lines}"


def _apply(tree: Path, patch: Path) -> subprocess.CompletedProcess:
    """`git am` a mail (git format-patch); a plain diff (the fuzz control's
    seed patch) is applied with `git apply` and committed under its file name."""
    with open(patch, "rb") as f:
        is_mail = f.read(5) == b"From "
    if is_mail:
        return run(["git", *GIT_ID, "-C", str(tree), "am", "-q", "--keep-cr", str(patch)],
                   capture=True, check=False, quiet=True)
    r = run(["git", *GIT_ID, "-C", str(tree), "apply", "--index", str(patch)],
            capture=True, check=False, quiet=True)
    if r.returncode == 0:
        _git(tree, "commit", "-q", "--no-verify", "-m", f"{patch.name} (plain diff)")
    return r


def prepare_tree(fl: Flavor, pristine: Path, want: str) -> Path:
    """The flavor's git tree at base + its series (want = series hash)."""
    tree = tree_dir(fl)
    if not (tree / ".git").is_dir():
        if tree.exists():
            shutil.rmtree(tree)
        _create_tree(fl, pristine)
    marker = tree / ".git" / "nodrop-series"
    if marker.exists() and marker.read_text().strip() == want:
        return tree
    patches = fl.patches()
    say(f"{fl.name}: applying series {fl.series} ({len(patches)} patches, sha256 {want[:12]})")
    marker.unlink(missing_ok=True)
    _git(tree, "am", "--abort", check=False)
    _git(tree, "reset", "-q", "--hard", "base")
    _git(tree, "clean", "-fdq")
    for p in patches:
        r = _apply(tree, p)
        if r.returncode != 0:
            msg = _am_failure(p, (r.stdout or "") + (r.stderr or ""))
            _git(tree, "am", "--abort", check=False)
            raise LabError(f"{fl.name}: {msg}")
        say(f"  applied {p.name}")
    marker.write_text(want + "\n")
    return tree


# --- make in a private mount namespace ------------------------------------------

def _mnt() -> tuple[Path, Path]:
    s, b = cache_dir() / "mnt" / "src", cache_dir() / "mnt" / "build"
    s.mkdir(parents=True, exist_ok=True)
    b.mkdir(parents=True, exist_ok=True)
    return s, b


def _ns_cmd(src: Path, bdir: Path, cmd: list[str]) -> list[str]:
    ms, mb = _mnt()
    script = 'mount --bind "$1" "$3" && mount --bind "$2" "$4" && shift 4 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
            "nodrop-ns", str(src), str(bdir), str(ms), str(mb), *cmd]


def _make_env() -> dict:
    cc = cache_dir() / "ccache"
    cc.mkdir(parents=True, exist_ok=True)
    return {"CCACHE_DIR": str(cc), "CCACHE_MAXSIZE": os.environ.get("CCACHE_MAXSIZE", "10G"),
            "KBUILD_BUILD_USER": "nodrop", "KBUILD_BUILD_HOST": "lab"}


def _make(fl: Flavor, src: Path, bdir: Path, targets: list[str], log: Path,
          extra: list[str] | None = None) -> None:
    ms, mb = _mnt()
    cmd = ["make", "-C", str(ms), f"O={mb}", "CC=ccache gcc", "HOSTCC=ccache gcc",
           f"LOCALVERSION={fl.localversion}", f"-j{jobs()}", *(extra or []), *targets]
    full = _ns_cmd(src, bdir, cmd)
    with open(log, "ab") as lf:
        lf.write(f"\n### {' '.join(cmd)}\n".encode())
        lf.flush()
        proc = subprocess.Popen(full, stdout=lf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **_make_env()})
        t0 = time.monotonic()
        stop = threading.Event()

        def heartbeat():
            while not stop.wait(60):
                last = tail_lines(log, 1)
                say(f"  ... {fl.name}: make {' '.join(targets)} {time.monotonic() - t0:.0f}s"
                    f" ({last[0].strip()[:80] if last else ''})")
        th = threading.Thread(target=heartbeat, daemon=True)
        th.start()
        try:
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            stop.set()
    if rc != 0:
        tail = "\n".join(tail_lines(log, 40))
        raise LabError(f"{fl.name}: make {' '.join(targets)} failed (exit {rc}); "
                       f"last lines of {log}:\n{tail}")


def _fragment_wants(frags) -> dict[str, str]:
    wants = {}
    for fr in frags:
        for ln in fr.read_text().splitlines():
            ln = ln.strip()
            m = re.match(r"^(CONFIG_\w+)=(.*)$", ln)
            if m:
                wants[m.group(1)] = m.group(2)
                continue
            m = re.match(r"^# (CONFIG_\w+) is not set$", ln)
            if m:
                wants[m.group(1)] = "n"
    return wants


def _check_config(fl: Flavor, bdir: Path) -> None:
    text = (bdir / ".config").read_text()
    have = dict(re.findall(r"^(CONFIG_\w+)=(.*)$", text, re.M))
    mentioned = set(re.findall(r"^# (CONFIG_\w+) is not set$", text, re.M)) | set(have)
    bad = []
    for k, v in _fragment_wants(fl.fragments).items():
        got = have.get(k, "n")
        if v != got:
            why = "unmet dependency" if k in mentioned else "unknown/hidden in this kernel"
            bad.append(f"{k}={v} (got {got}: {why})")
    if bad:
        say(f"{fl.name}: note: fragment options not in the final .config: {', '.join(bad)}")


def configure(fl: Flavor, src: Path, bdir: Path, log: Path) -> None:
    want = fl.config_hash()
    cs = bdir / CONFIG_STAMP
    if (bdir / ".config").exists() and cs.exists() and cs.read_text().strip() == want:
        return
    say(f"{fl.name}: configuring (tinyconfig + {', '.join(f.name for f in fl.fragments)})")
    cs.unlink(missing_ok=True)
    _make(fl, src, bdir, ["tinyconfig"], log)
    ms, mb = _mnt()
    merge = ["sh", str(ms / "scripts" / "kconfig" / "merge_config.sh"), "-m", "-O", str(mb),
             str(mb / ".config"), *(str(f) for f in fl.fragments)]
    with open(log, "ab") as lf:
        r = subprocess.run(_ns_cmd(src, bdir, merge), stdout=lf, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, cwd=bdir)
    if r.returncode != 0:
        raise LabError(f"{fl.name}: merge_config.sh failed; see {log}")
    _make(fl, src, bdir, ["olddefconfig"], log)
    _check_config(fl, bdir)
    cs.write_text(want + "\n")


def kernel(fl: Flavor, *, rebuild: bool = False) -> Built:
    pristine = fetch(fl.source)
    upstream = upstream_version(pristine)
    bdir = build_dir(fl)
    stamp_p = bdir / STAMP
    bz = bdir / "arch" / "x86" / "boot" / "bzImage"
    series_hash = fl.series_hash()
    patches = [p.name for p in fl.patches()]
    want = {"source_package": fl.source.package, "source_version": fl.source.version,
            "config_hash": fl.config_hash(), "series_hash": series_hash}
    src = tree_dir(fl) if fl.series else pristine

    def stamp_ok() -> dict | None:
        try:
            st = json.loads(stamp_p.read_text())
        except (OSError, ValueError):
            return None
        if all(st.get(k) == v for k, v in want.items()) and bz.exists():
            return st
        return None

    def reuse(how: str) -> Built | None:
        st = None if rebuild else stamp_ok()
        if st is None:
            return None
        say(f"{fl.name}: {how} ({st['kernelrelease']}), not running make")
        return Built(fl, bz, bdir, st["kernelrelease"], src, upstream, want["config_hash"],
                     series_hash, patches, True, None)

    if (b := reuse("up to date")) is not None:
        return b
    with build_lock():
        # a background build (`make test` builds later rows' kernels ahead)
        # may have finished it while we waited for the lock
        if (b := reuse("built meanwhile")) is not None:
            return b
        if fl.series:
            src = prepare_tree(fl, pristine, series_hash)
        bdir.mkdir(parents=True, exist_ok=True)
        stamp_p.unlink(missing_ok=True)
        log = bdir / "build.log"
        log.write_text("")
        t0 = time.monotonic()
        configure(fl, src, bdir, log)
        say(f"{fl.name}: make bzImage -j{jobs()} (log: {log})")
        _make(fl, src, bdir, ["bzImage"], log)
        secs = time.monotonic() - t0
        rel = (bdir / "include" / "config" / "kernel.release").read_text().strip()
        stamp = dict(want, kernelrelease=rel, upstream=upstream, patches=patches,
                     built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), build_seconds=round(secs, 1))
        stamp_p.write_text(json.dumps(stamp, indent=2) + "\n")
        prune_builds(fl)
    say(f"{fl.name}: built {rel} in {secs:.0f}s")
    return Built(fl, bz, bdir, rel, src, upstream, want["config_hash"], series_hash,
                 patches, False, secs)
