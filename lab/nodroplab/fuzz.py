"""`fuzz FLAVOR`: syzkaller against one of our kernels (docs/fuzz.md).

* syzkaller: the commit pinned in lab/fuzz.toml, exported with `git archive`
  from a local mirror into $NODROP_CACHE/syzkaller/<commit>-<desc12>/ with
  our descriptions (fuzz/sys/) copied over its sys/, built once with the
  host's Go (modules from the Go proxy) and g++ (static syz-executor).
* image: a small ext4 image made once by the lab under
  $NODROP_CACHE/fuzz/image-<spec12>/: debootstrap minbase + openssh-server +
  iproute2, an init script (/sbin/nodrop-fuzz-init) that mounts what the
  executor needs, configures eth0 for QEMU's user network and runs sshd;
  root logs in with the image's own key. Booted with -snapshot.
* run: syz-manager with QEMU TCG VMs (lab/fuzz.toml [manager]) booting the
  flavor's bzImage, its vmlinux for symbolization and coverage, the syscalls
  and focus areas of lab/fuzz.toml. Workdir (corpus.db, crashes) persists in
  $NODROP_CACHE/fuzz/work/<flavor>/, so a later run continues the corpus.
* results: results/fuzz/<flavor>/<run>/ (summary.json, the manager config,
  the manager log) and results/fuzz/crashes/<flavor>/<title>/ (syzkaller's
  title, report, reproducers), plus coverage of the functions our series
  adds or changes (cover.json, from syzkaller's /cover?jsonl=1).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

from .common import LAB_DIR, REPO, RESULTS, LabError, cache_dir, run, say, timestamp
from .kernel import Built, _fragment_wants
from .matrix import Flavor

FUZZ_FILE = LAB_DIR / "fuzz.toml"
DESCRIPTIONS = REPO / "fuzz" / "sys"
SYZ_PATCHES = REPO / "fuzz" / "syzkaller"     # our patches to the pinned syzkaller (patch -p1)
SEEDCHECK = REPO / "fuzz" / "seedcheck"       # bin/nodrop-seedcheck: our seeds must parse strictly
DEFAULT_MIRROR = "/work/.mirror/google+syzkaller/repo"

# Debian 12 packages: building syzkaller (g++ and static libc/libstdc++ for
# syz-executor, git for the export), making the image (debootstrap, mkfs.ext4
# -d), talking to the VMs (ssh, scp, ssh-keygen) and running them (QEMU).
FUZZ_APT = ["g++", "libc6-dev", "libstdc++-12-dev", "make", "git", "patch", "debootstrap",
            "debian-archive-keyring", "e2fsprogs", "openssh-client", "qemu-system-x86"]

IMAGE_SUITE = "bookworm"
IMAGE_PACKAGES = ["openssh-server", "iproute2"]
IMAGE_SIZE = "1G"

INIT_SCRIPT = """#!/bin/sh
# NODROP fuzz image init (lab/nodroplab/fuzz.py): what syz-executor needs,
# eth0 on QEMU's user network (ssh from syz-manager), then sshd as PID 1's job.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t debugfs debugfs /sys/kernel/debug
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /dev/pts /dev/shm /run/sshd
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
hostname nodrop-fuzz
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
echo "nodrop-fuzz-init: sshd starting"
/usr/sbin/sshd -D -e
echo "nodrop-fuzz-init: sshd exited"
sync
echo o > /proc/sysrq-trigger
"""

SSHD_CONFIG = """# NODROP fuzz image: root by key only, no DNS lookups (slow under TCG)
PermitRootLogin prohibit-password
PasswordAuthentication no
UseDNS no
"""


def load_cfg() -> dict:
    try:
        return tomllib.loads(FUZZ_FILE.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LabError(f"cannot read {FUZZ_FILE}: {e}")


def _hash_tree(h, root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")


# --- syzkaller -----------------------------------------------------------------

def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists()
                                else None)
    if go is None:
        raise LabError("Go toolchain not found (no `go` in PATH, no /usr/local/go/bin/go): "
                       "syzkaller is a Go program; install Go >= the version in its go.mod")
    return go


def syzkaller(cfg: dict) -> Path:
    """The built syzkaller tree of the pinned commit (+ our descriptions)."""
    commit = cfg["syzkaller"]["commit"]
    h = hashlib.sha256()
    _hash_tree(h, DESCRIPTIONS)
    _hash_tree(h, SYZ_PATCHES)
    _hash_tree(h, SEEDCHECK)
    dest = cache_dir() / "syzkaller" / f"{commit[:12]}-{h.hexdigest()[:12]}"
    if not (dest / ".nodrop-built").exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.parent / "build.lock", "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            if not (dest / ".nodrop-built").exists():
                _build_syzkaller(commit, dest)
    return dest


def _build_syzkaller(commit: str, dest: Path) -> None:
    mirror = Path(os.environ.get("NODROP_SYZKALLER_GIT", DEFAULT_MIRROR))
    r = run(["git", "-C", str(mirror), "cat-file", "-e", f"{commit}^{{commit}}"],
            check=False, capture=True, quiet=True)
    if r.returncode != 0:
        raise LabError(f"syzkaller commit {commit} (lab/fuzz.toml) not found in the git "
                       f"mirror {mirror}: get google/syzkaller there (or point "
                       f"NODROP_SYZKALLER_GIT at a clone that has it)")
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # A mirror may lack some large blobs (test data only); export the rest.
    tree = run(["git", "-C", str(mirror), "ls-tree", "-r", commit], capture=True,
               quiet=True).stdout.splitlines()
    objs = [ln.split()[2] for ln in tree]
    chk = subprocess.run(["git", "-C", str(mirror), "cat-file", "--batch-check"],
                         input="\n".join(objs) + "\n", capture_output=True, text=True)
    missing = {ln.split()[0] for ln in chk.stdout.splitlines() if ln.endswith(" missing")}
    absent = [ln.split("\t", 1)[1] for ln in tree if ln.split()[2] in missing]
    bad = [p for p in absent if "test" not in p]
    if bad:
        raise LabError(f"syzkaller {commit[:12]}: the mirror {mirror} lacks "
                       f"{', '.join(bad[:5])}: refresh it")
    say(f"syzkaller {commit[:12]}: exporting to {tmp}"
        + (f" (without {len(absent)} absent test-data files)" if absent else ""))
    arch = subprocess.Popen(["git", "-C", str(mirror), "archive", commit, "--", ".",
                             *(f":(exclude){p}" for p in absent)], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=arch.stdout, check=True)
    if arch.wait() != 0:
        raise LabError(f"git archive {commit} from {mirror} failed")
    shutil.copytree(DESCRIPTIONS, tmp / "sys", dirs_exist_ok=True)
    for p in sorted(SYZ_PATCHES.glob("*.patch")):
        r = run(["patch", "-p1", "--forward", "-i", str(p)], cwd=tmp, capture=True,
                check=False, quiet=True)
        if r.returncode != 0:
            raise LabError(f"syzkaller {commit[:12]}: our patch {p} does not apply:\n  "
                           + "\n  ".join((r.stdout + r.stderr).strip().splitlines()[-8:]))
        say(f"syzkaller {commit[:12]}: applied {p.name}")
    go = _go()
    log = tmp / "nodrop-build.log"
    env = {"PATH": f"{Path(go).parent}:{os.environ.get('PATH', '')}",
           "GOPROXY": os.environ.get("GOPROXY", "https://proxy.golang.org,direct")}
    say(f"syzkaller {commit[:12]}: make manager repro execprog executor (log: {log})")
    t0 = time.monotonic()
    date = run(["git", "-C", str(mirror), "show", "-s", "--format=%cd",
                "--date=format:%Y%m%d-%H%M%S", commit], capture=True, quiet=True).stdout.strip()
    r = run(["make", f"REV={commit}", f"GITREVDATE={date}", "manager", "repro", "execprog",
             "executor"], cwd=tmp, env=env, log=log, check=False, quiet=True)
    tail = "\n  ".join(log.read_text(errors="replace").splitlines()[-15:])
    if r.returncode != 0:
        hint = ""
        if re.search(r"cannot find -l|crt1\.o", tail):
            hint = ("\n  (syz-executor links statically: apt-get install g++ libc6-dev "
                    "libstdc++-12-dev)")
        elif "proxy.golang.org" in tail or "dial tcp" in tail:
            hint = "\n  (Go modules come from the Go proxy: check GOPROXY / the network)"
        raise LabError(f"building syzkaller failed (exit {r.returncode}); last lines of "
                       f"{log}:\n  {tail}{hint}")
    for b in ("bin/syz-manager", "bin/syz-repro", "bin/linux_amd64/syz-executor"):
        if not (tmp / b).is_file():
            raise LabError(f"building syzkaller: {b} missing after make (log: {log})")
    # our seed programs (fuzz/sys/linux/test/, copied over sys/linux/test/)
    # against the descriptions just built: syz-manager would skip a broken one
    shutil.copytree(SEEDCHECK, tmp / "tools" / "nodrop-seedcheck")
    run([go, "build", "-o", "bin/nodrop-seedcheck", "./tools/nodrop-seedcheck"], cwd=tmp,
        env=env, log=log, quiet=True)
    seeds = sorted(str(p.relative_to(DESCRIPTIONS)) for p in DESCRIPTIONS.glob("*/test/*"))
    r = run([str(tmp / "bin/nodrop-seedcheck"), *seeds], cwd=tmp / "sys", capture=True,
            check=False, quiet=True)
    if r.returncode != 0:
        raise LabError("our syzkaller seed programs do not parse against the descriptions "
                       "(fuzz/sys/):\n  " + "\n  ".join(
                           ln for ln in r.stdout.splitlines() if not ln.endswith(": ok")))
    say(f"syzkaller {commit[:12]}: {len(seeds)} seed program(s) of ours parse strictly")
    (tmp / ".nodrop-built").write_text(json.dumps(
        {"commit": commit, "seconds": round(time.monotonic() - t0)}) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    say(f"syzkaller {commit[:12]}: built in {time.monotonic() - t0:.0f}s -> {dest}")


# --- image -----------------------------------------------------------------------

def image() -> tuple[Path, Path]:
    """(image file, ssh private key) of the lab's fuzz image, made once."""
    spec = json.dumps([IMAGE_SUITE, IMAGE_PACKAGES, IMAGE_SIZE, INIT_SCRIPT, SSHD_CONFIG, 1])
    d = cache_dir() / "fuzz" / f"image-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    img, key = d / "image.ext4", d / "key"
    if (d / ".ok").exists():
        return img, key
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / "image.lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if not (d / ".ok").exists():
            _make_image(d)
    return img, key


def _rmtree_unmounted(path: Path) -> None:
    """rmtree, but never through a mount point (a debootstrap killed midway
    can leave /proc mounted in its target)."""
    mounts = [ln.split()[1] for ln in Path("/proc/mounts").read_text().splitlines()]
    inside = [m for m in mounts if m == str(path) or m.startswith(str(path) + "/")]
    if inside:
        raise LabError(f"{path}: still mounted ({', '.join(inside)}): umount, then retry")
    shutil.rmtree(path)


def _make_image(d: Path) -> None:
    from .rootfs import APT, DEBIAN_MIRROR, POLICY_RC, _with_debs, chroot, debootstrap
    tmp = d.with_name(d.name + ".tmp")
    if tmp.exists():
        _rmtree_unmounted(tmp)
    root = tmp / "root"
    tmp.mkdir(parents=True)
    log = tmp / "build.log"
    say(f"fuzz image: debootstrap {IMAGE_SUITE} + {', '.join(IMAGE_PACKAGES)} (log: {log})")
    debs = debootstrap("fuzz image", IMAGE_SUITE, root, DEBIAN_MIRROR, log)
    prc = root / "usr/sbin/policy-rc.d"          # never start sshd in the chroot
    prc.write_text(POLICY_RC)
    prc.chmod(0o755)
    _with_debs(root, debs, ["apt-get", "-q", "update"], log)
    _with_debs(root, debs, [*APT, "install", *IMAGE_PACKAGES], log)
    chroot(root, ["apt-get", "clean"], log=log, quiet=True)
    prc.unlink()
    init = root / "sbin/nodrop-fuzz-init"
    init.write_text(INIT_SCRIPT)
    init.chmod(0o755)
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/nodrop-fuzz.conf").write_text(SSHD_CONFIG)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "nodrop-fuzz", "-f",
         str(tmp / "key")], quiet=True)
    ssh = root / "root/.ssh"
    ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copy(tmp / "key.pub", ssh / "authorized_keys")
    (ssh / "authorized_keys").chmod(0o600)
    (root / "etc/hostname").write_text("nodrop-fuzz\n")
    (root / "etc/fstab").write_text("")
    run(["mkfs.ext4", "-q", "-F", "-L", "nodrop-fuzz", "-d", str(root),
         str(tmp / "image.ext4"), IMAGE_SIZE], log=log, quiet=True)
    _rmtree_unmounted(root)
    (tmp / ".ok").write_text("\n")
    if d.exists():
        shutil.rmtree(d)
    tmp.rename(d)
    say(f"fuzz image ready: {d / 'image.ext4'}")


# --- the run -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manager_config(cfg: dict, b: Built, syz: Path, img: Path, key: Path, workdir: Path,
                   port: int) -> dict:
    m = cfg["manager"]
    vm = dict(cfg["vm"])
    vm["kernel"] = str(b.bzimage)
    return {
        "name": b.flavor.name,
        "target": "linux/amd64",
        "http": f"127.0.0.1:{port}",
        "workdir": str(workdir),
        "kernel_obj": str(b.build_dir),
        "kernel_src": str(b.source_tree),
        # the lab compiles every flavor with its source bind-mounted here
        "kernel_build_src": str(cache_dir() / "mnt" / "src"),
        "image": str(img),
        "sshkey": str(key),
        "ssh_user": "root",
        "syzkaller": str(syz),
        "procs": m["procs"],
        "sandbox": m["sandbox"],
        "cover": True,
        "reproduce": m["reproduce"],
        "enable_syscalls": m["enable_syscalls"],
        # an experimental option in the pinned syzkaller (mgrconfig.Experimental)
        "experimental": {"focus_areas": cfg["focus_areas"]},
        "type": "qemu",
        "vm": vm,
    }


def _metrics(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for ln in text.splitlines():
        m = re.match(r"^(syz_[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", ln)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _slug(title: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", title).strip("_")[:100]


SMOKE_BOOT = 1800      # seconds a smoke run waits for the first execution

CRASH_FILES = ("description", "report0", "repro.prog", "repro.cprog", "repro.report",
               "repro.log")


def collect_crashes(workdir: Path, flavor: str) -> list[dict]:
    """syzkaller's deduplicated crashes (one dir per title) -> results/fuzz/crashes/."""
    out = []
    for d in sorted((workdir / "crashes").glob("*")):
        desc = d / "description"
        if not desc.is_file():
            continue
        title = desc.read_text().strip()
        dst = RESULTS / "fuzz" / "crashes" / flavor / _slug(title)
        dst.mkdir(parents=True, exist_ok=True)
        for f in CRASH_FILES:
            if (d / f).is_file():
                shutil.copy(d / f, dst / f)
        logs = sorted(d.glob("log*"), key=lambda p: p.stat().st_mtime)
        if logs:      # the console log of the first occurrence, last 300 lines
            lines = logs[0].read_text(errors="replace").splitlines()[-300:]
            (dst / "console-tail.txt").write_text("\n".join(lines) + "\n")
        out.append({"title": title, "kernel": is_kernel_crash(title),
                    "dir": str(dst.relative_to(REPO)),
                    "occurrences": len(list(d.glob("log*"))),
                    "first_seen": min((p.stat().st_mtime for p in logs), default=None),
                    "reproducer": (d / "repro.prog").is_file(),
                    "c_reproducer": (d / "repro.cprog").is_file()})
    return out


# syzkaller titles of its own failures and of a VM it lost, not kernel reports
INFRA_TITLES = ("SYZFAIL:", "lost connection to test machine", "no output from test machine",
                "timed out", "executor failed")


def is_kernel_crash(title: str) -> bool:
    return not title.startswith(INFRA_TITLES)


def crash_timeline(log: Path, t0_wall: float) -> list[dict]:
    """Every crash syz-manager logged ("VM n: crash: <title>"), with the
    seconds since the run started and whether the title is a kernel report."""
    out = []
    for ln in log.read_text(errors="replace").splitlines():
        m = re.match(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) VM \d+: crash: (.*)$", ln)
        if m:
            t = datetime.datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S").timestamp()
            out.append({"seconds": round(t - t0_wall), "title": m.group(2),
                        "kernel": is_kernel_crash(m.group(2))})
    return out


def _changed_lines(tree: Path, paths: list[str]) -> dict[str, set[int]]:
    """Post-image line numbers the series adds or changes, per file."""
    diff = run(["git", "-C", str(tree), "diff", "-U0", "base", "HEAD", "--", *paths],
               capture=True, quiet=True).stdout
    out: dict[str, set[int]] = {}
    cur = None
    for ln in diff.splitlines():
        if ln.startswith("+++ "):
            cur = ln[6:] if ln.startswith("+++ b/") else None
        m = re.match(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", ln)
        if m and cur:
            start, n = int(m.group(1)), int(m.group(2) or 1)
            out.setdefault(cur, set()).update(range(start, start + n))
    return out


def coverage(port: int, changed: dict[str, set[int]], paths: list[str]) -> dict:
    """Line coverage of the functions our series adds or changes.

    A function counts as changed when one of its instrumented lines lies in a
    line the series adds or changes (git diff base..HEAD in the flavor's tree).
    Lines = source lines with at least one KCOV callback (syzkaller's frames,
    inlined copies included); covered = at least one of them hit."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/cover?jsonl=1",
                                    timeout=1800) as r:
            frames = [json.loads(ln) for ln in r.read().decode().splitlines() if ln.strip()]
    except OSError as e:
        return {"error": f"coverage report not available: {e}"}
    lines: dict[tuple[str, str], dict[int, bool]] = {}
    for f in frames:
        path = re.sub(r"^.*?/mnt/src/", "", f["file_path"])
        if not any(path.startswith(p) for p in paths):
            continue
        key = (path, f["func_name"])
        per = lines.setdefault(key, {})
        for ln in range(f["sl"], max(f["sl"], f["el"]) + 1):
            per[ln] = per.get(ln, False) or f["hit_count"] > 0
    funcs = []
    for (path, fn), per in sorted(lines.items()):
        if not changed.get(path, set()) & set(per):
            continue
        funcs.append({"file": path, "function": fn, "lines": len(per),
                      "covered": sum(per.values())})
    tot = sum(f["lines"] for f in funcs)
    cov = sum(f["covered"] for f in funcs)
    return {"functions": funcs, "lines": tot, "covered": cov,
            "percent": round(100.0 * cov / tot, 1) if tot else None}


def check_flavor(fl: Flavor) -> None:
    """Refuse a flavor without KCOV and KASAN before spending a build on it."""
    wants = _fragment_wants(fl.fragments)
    missing = [o for o in ("CONFIG_KCOV", "CONFIG_KASAN", "CONFIG_DEBUG_FS")
               if wants.get(o) != "y"]
    if missing:
        raise LabError(f"{fl.name} is not a fuzz flavor ({', '.join(missing)} not set by its "
                       f"fragments): use a *-fuzz flavor or seed-v1-6.12 (make flavors), or add "
                       f"lab/config/fuzz.config to it (docs/fuzz.md)", rc=2)


def fuzz(b: Built, duration: int, *, smoke: bool = False) -> int:
    cfg = load_cfg()
    syz = syzkaller(cfg)
    img, key = image()
    vmlinux = b.build_dir / "vmlinux"
    if not vmlinux.is_file():
        raise LabError(f"{b.flavor.name}: {vmlinux} missing (symbolization and coverage "
                       "need the flavor's vmlinux)")
    config_text = (b.build_dir / ".config").read_text()
    for opt in ("CONFIG_KCOV", "CONFIG_KASAN"):
        if f"{opt}=y" not in config_text:
            raise LabError(f"{b.flavor.name}: {opt} is not set: make fuzz needs a fuzz "
                           f"flavor (lab/flavors.toml, lab/config/fuzz.config)", rc=2)
    workdir = cache_dir() / "fuzz" / "work" / b.flavor.name
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = timestamp()
    out = RESULTS / "fuzz" / b.flavor.name / run_id
    out.mkdir(parents=True, exist_ok=True)
    # the series' lines now: the flavor's tree is shared with other flavors
    # of the same series directory and may be re-patched while we fuzz
    paths = cfg["coverage"]["paths"]
    changed = _changed_lines(b.source_tree, paths) if b.flavor.series else {}
    port = _free_port()
    mcfg = manager_config(cfg, b, syz, img, key, workdir, port)
    (out / "manager.json").write_text(json.dumps(mcfg, indent=2) + "\n")
    titles_before = {(p / "description").read_text().strip()
                     for p in (workdir / "crashes").glob("*") if (p / "description").is_file()}
    log = out / "manager.log"
    say(f"{b.flavor.name}: syz-manager for {duration}s, {mcfg['vm']['count']} VM(s) x "
        f"{mcfg['vm']['cpu']} vCPU, TCG (http://127.0.0.1:{port}, log {log}, "
        f"workdir {workdir})")
    t0, t0_wall = time.monotonic(), time.time()
    with open(log, "wb") as lf:
        proc = subprocess.Popen([str(syz / "bin/syz-manager"), "-config",
                                 str(out / "manager.json")], stdout=lf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    first_crash = None
    stats: dict[str, float] = {}
    # smoke: DURATION of executing programs, after the VM's boot (up to SMOKE_BOOT)
    deadline = t0 + (SMOKE_BOOT if smoke else duration)
    booting = smoke
    # SIGINT/SIGTERM (Ctrl-C, kill) end the run early, with its summary
    stopped: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _f: stopped.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while time.monotonic() < deadline and proc.poll() is None and not stopped:
            time.sleep(15)
            s = _metrics(port)
            if s:
                stats = s
            if booting and stats.get("syz_exec_total", 0) > 0:
                booting = False
                say(f"{b.flavor.name}: smoke: programs executing after "
                    f"{time.monotonic() - t0:.0f}s; {duration}s more")
                deadline = time.monotonic() + duration
            if first_crash is None and stats.get("syz_crash_total", 0) > 0:
                first_crash = round(time.monotonic() - t0)
                say(f"{b.flavor.name}: first crash report after {first_crash}s "
                    "(syz-manager's count: its own failures too; the titles are in the summary)")
            if int(time.monotonic() - t0) % 300 < 15:
                say(f"{b.flavor.name}: {time.monotonic() - t0:.0f}s: executed "
                    f"{stats.get('syz_exec_total', 0):.0f}, corpus cover "
                    f"{stats.get('syz_corpus_cover', 0):.0f}, crashes "
                    f"{stats.get('syz_crash_total', 0):.0f}")
        if proc.poll() is not None:
            tail = "\n  ".join(log.read_text(errors="replace").splitlines()[-20:])
            raise LabError(f"{b.flavor.name}: syz-manager exited early (exit "
                           f"{proc.returncode}); last lines of {log}:\n  {tail}")
        if stopped:
            say(f"{b.flavor.name}: {signal.Signals(stopped[0]).name} after "
                f"{time.monotonic() - t0:.0f}s: ending the run early")
        cover = coverage(port, changed, paths) if not smoke else {}
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        _stop(proc)
    elapsed = round(time.monotonic() - t0)
    crashes = collect_crashes(workdir, b.flavor.name)
    timeline = crash_timeline(log, t0_wall)
    for c in crashes:
        c["new_in_this_run"] = c["title"] not in titles_before
    summary = {"flavor": b.flavor.name, "kernelrelease": b.kernelrelease, "run": run_id,
               "syzkaller": cfg["syzkaller"]["commit"], "seconds": elapsed,
               "vms": mcfg["vm"]["count"], "vcpus": mcfg["vm"]["cpu"],
               "executed": int(stats.get("syz_exec_total", 0)),
               "corpus_cover": int(stats.get("syz_corpus_cover", 0)),
               "crash_reports": int(stats.get("syz_crash_total", 0)),
               "first_crash_seconds": first_crash,
               "stopped_early": bool(stopped),
               "first_kernel_crash_seconds": next(
                   (c["seconds"] for c in timeline if c["kernel"]), None),
               "crash_timeline": timeline, "crashes": crashes,
               "coverage": cover, "workdir": str(workdir)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(f"{b.flavor.name}: {elapsed}s, executed {summary['executed']}, "
        f"{len(crashes)} distinct crash title(s) in the workdir "
        f"({', '.join(c['title'] for c in crashes) or 'none'}); summary {out / 'summary.json'}")
    if cover.get("percent") is not None:
        say(f"{b.flavor.name}: changed functions: {cover['covered']}/{cover['lines']} lines "
            f"({cover['percent']} %)")
    if smoke and summary["executed"] == 0:
        raise LabError(f"{b.flavor.name}: smoke: no program executed in {elapsed}s "
                       f"(see {log})")
    print(out)
    return 0
