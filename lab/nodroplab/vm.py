"""Boot a built kernel with virtme-ng and run one command in the guest.

The guest sees the host root filesystem (9p, read-only, with virtme-ng's
tmpfs overlays on /etc /lib /home /opt /srv /usr /var /tmp) plus one
read-write results directory (--rwdir, same path as on the host). The
command's stdout/stderr/exit code travel through files in that directory,
never through the console (virtme-ng's console can lose output); the host
tails the files while the guest runs and relays them to its own terminal.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .common import REPO, LabError, cache_dir, say, tail_lines
from .deps import lab_python, vng_path

# Guest clocks (`make bench CLOCK=...`). wall: QEMU's default, the guest
# clock follows the host's. icount: the guest clock advances with executed
# instructions (shift=0: 1 ns per instruction; align=off: never wait for the
# host clock; sleep=off: idle time is skipped, not slept), so guest-time
# rates are instruction budgets that host load cannot move. TCG only.
CLOCK_OPTS = {"wall": [], "icount": ["-icount", "shift=0,align=off,sleep=off"]}

PROBE_BOOTSECTOR = bytes([0xB0, 0x01, 0xE6, 0xF4, 0xF4, 0xEB, 0xFD])  # out 0xf4,1; hlt
_KVM: tuple[bool, str] | None = None


def _qemu_version() -> str:
    try:
        out = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                             text=True).stdout
        return out.splitlines()[0] if out else "?"
    except OSError:
        return "?"


def kvm_probe() -> tuple[bool, str]:
    """Can QEMU run a guest with KVM and the CPU model vng uses (-cpu host)?

    Boots a 7-byte boot sector that writes to isa-debug-exit: QEMU exits 3 when
    the guest ran. Probed once per lab process; the answer is also kept per
    host boot (boot_id) in $NODROP_CACHE/kvm-probe.json. NODROP_KVM=0/1 forces."""
    global _KVM
    if _KVM is not None:
        return _KVM
    force = os.environ.get("NODROP_KVM", "auto")
    if force in ("0", "1"):
        _KVM = (force == "1", f"forced by NODROP_KVM={force}")
        return _KVM
    key = _probe_key()
    try:
        c = json.loads(_probe_cache().read_text())
        if (c.get("boot_id"), c.get("qemu")) == key:
            _KVM = (bool(c["kvm"]), c["reason"] + " (probed earlier this host boot)")
            return _KVM
    except (OSError, ValueError, KeyError):
        pass
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        res = (False, "/dev/kvm missing or not accessible")
    else:
        img = cache_dir() / "kvm-probe.img"
        img.parent.mkdir(parents=True, exist_ok=True)
        img.write_bytes(PROBE_BOOTSECTOR + b"\0" * (510 - len(PROBE_BOOTSECTOR)) + b"\x55\xaa")
        cmd = ["qemu-system-x86_64", "-accel", "kvm", "-cpu", "host", "-M", "pc", "-m", "32",
               "-display", "none", "-nodefaults", "-no-reboot",
               "-drive", f"file={img},format=raw", "-device", "isa-debug-exit,iobase=0xf4,iosize=4"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=15,
                               stdin=subprocess.DEVNULL)
            if p.returncode == 3:
                res = (True, "KVM probe guest ran")
            else:
                err = [ln for ln in p.stderr.splitlines() if "warning" not in ln]
                res = (False, f"KVM probe failed (qemu exit {p.returncode}: "
                              f"{err[0] if err else ''})")
        except subprocess.TimeoutExpired:
            res = (False, "KVM probe guest did not finish in 15s")
    _remember(res)
    return res


def _probe_cache() -> Path:
    return cache_dir() / "kvm-probe.json"


@functools.lru_cache(maxsize=None)
def _probe_key() -> tuple[str, str]:
    """What the cached verdict holds for: this host boot, this QEMU (asked
    once per process: kvm_probe() and _remember() both need it)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "?"
    return boot_id, _qemu_version()


def _remember(res: tuple[bool, str]) -> None:
    """The KVM verdict for this process and, through the cache, for every
    lab process of this host boot."""
    global _KVM
    _KVM = res
    boot_id, qv = _probe_key()
    cache = _probe_cache()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"boot_id": boot_id, "qemu": qv, "kvm": res[0],
                                 "reason": res[1]}) + "\n")


@dataclass
class GuestResult:
    rc: int | None                 # exit code of the command, None = no rc file
    booted: bool                   # the guest started our script
    uname: str | None
    kvm: bool
    boot_seconds: float | None     # host: vng start -> guest script started
    guest_uptime: float | None     # guest /proc/uptime when the script started
    wall_seconds: float
    console: Path
    timed_out: bool
    kvm_error: bool = False        # under KVM: internal error, or no kernel output (hang)
    retried: str | None = None     # boot_and_run(retry_unbooted=True): why the first boot was repeated


GUEST_SCRIPT = r"""# generated by lab/nodroplab/vm.py; runs inside the guest
M={meta}
cat /proc/uptime > "$M/uptime" 2>/dev/null
uname -r > "$M/uname"
: > "$M/started"
{exports}
cd {cwd} || {{ echo "guest: cannot cd to "{cwd} > "$M/../stderr"; echo 126 > "$M/rc"; exit 1; }}
/bin/sh "$M/cmd" > "$M/../stdout" 2> "$M/../stderr" < /dev/null
echo $? > "$M/rc.tmp"
mv "$M/rc.tmp" "$M/rc"
"""


class _Tail:
    """Relay a growing file to a host stream."""

    def __init__(self, path: Path, out):
        self.path, self.out, self.pos = path, out, 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return
        if data:
            self.pos += len(data)
            self.out.buffer.write(data)
            self.out.flush()


# Set when the lab is interrupted while guests run in worker threads (make
# bench with GUESTS > 1): each guest's loop stops and kills its QEMU, as the
# KeyboardInterrupt does in the main thread.
ABORT = threading.Event()


def _kill_group(proc: subprocess.Popen) -> None:
    """Terminate vng, virtme-run and QEMU (they share the process group)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        except (OSError, IndexError, ValueError):
            continue
    return False


def boot_and_run(bzimage: Path, cmd: str, rwdir: Path, *, env: dict[str, str],
                 cwd: Path, timeout: float, boot_timeout: float = 300,
                 relay: bool = True, cpus: int = 2, memory: str = "2G",
                 clock: str = "wall", root: Path | None = None,
                 shares: tuple[str, ...] = (), retry_unbooted: bool = False) -> GuestResult:
    """Boot `bzimage`, run `cmd` (a sh command line) as root in the guest.

    clock: a CLOCK_OPTS key; anything but "wall" boots with TCG.
    root: a root filesystem tree to boot instead of the host's (vng --root,
    read-write: pass a throw-away copy); rwdir and `shares` (vng
    --rodir/--rwdir options) must then name mount points that exist in it.
    retry_unbooted: if the guest ends (QEMU exits: vng boots with panic=-1)
    before it starts the command, boot it once more; the first console is
    kept as console-first-boot.log and GuestResult.retried says so; a soft
    lockup reported before the command counts as such an end (the boot is
    stopped then, not left to the boot timeout). Only for guests where
    nothing of ours runs before the command (Debian's own kernel, docs/lab.md:
    TCG flakes); never on a timeout.
    Files in rwdir: stdout, stderr, console.log, .nodrop/{cmd,guest.sh,rc,uname,...}."""
    if clock not in CLOCK_OPTS:
        raise LabError(f"unknown clock {clock!r}; valid: {', '.join(CLOCK_OPTS)}", rc=2)
    rwdir = rwdir.resolve()
    meta = rwdir / ".nodrop"
    meta.mkdir(parents=True, exist_ok=True)
    for name in ("rc", "rc.tmp", "uname", "started", "uptime"):
        (meta / name).unlink(missing_ok=True)
    (rwdir / "stdout").write_bytes(b"")
    (rwdir / "stderr").write_bytes(b"")
    (meta / "cmd").write_text(cmd + "\n")
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    (meta / "guest.sh").write_text(GUEST_SCRIPT.format(
        meta=shlex.quote(str(meta)), exports=exports, cwd=shlex.quote(str(cwd))))
    console = rwdir / "console.log"

    kvm, why = kvm_probe() if clock == "wall" else (False, f"clock {clock} needs TCG")
    # KVM first if it works here, then TCG; a second TCG boot only for
    # retry_unbooted, and only if the first one ended before the command
    attempts = [True] * kvm + [False] * (1 + retry_unbooted)
    retried = None
    for n, use_kvm in enumerate(attempts, 1):
        res = _boot_once(bzimage, rwdir, meta, console, use_kvm, timeout, boot_timeout,
                         relay, cpus, memory, CLOCK_OPTS[clock], root, shares,
                         lockup_ends_boot=retry_unbooted and not use_kvm)
        res.retried = retried
        if use_kvm and res.booted and not res.kvm_error:
            return res
        if not use_kvm and (res.booted or res.timed_out or n == len(attempts)):
            return res
        if not use_kvm:
            retried = _keep_first_console(res, rwdir, bzimage)
        elif res.kvm_error:
            kvm_broken(f"KVM failed a guest ({bzimage}): internal error or no output "
                       f"in {KVM_SILENT_S}s")
            say(f"under KVM the guest stopped (KVM internal error) or printed nothing in "
                f"{KVM_SILENT_S}s (this host's KVM cannot run every guest); running it "
                "again with TCG (--disable-kvm), and every later guest of this host boot "
                "with TCG")
        else:
            say("guest did not start with KVM; retrying once with TCG (--disable-kvm)")
    return res


def _keep_first_console(res: GuestResult, rwdir: Path, bzimage: Path) -> str:
    """retry_unbooted: keep the console of a boot that ended before the
    command, as console-first-boot.log; what GuestResult.retried says."""
    first = rwdir / "console-first-boot.log"
    first.write_bytes(res.console.read_bytes() if res.console.exists() else b"")
    lines = [ln.strip() for ln in tail_lines(first, 80) if ln.strip()]
    crash = next((ln for ln in lines if any(w in ln for w in CRASH_WORDS)),
                 lines[-1] if lines else "")
    say(report_failure(res, str(bzimage)) + "\nbooting it once more (retry_unbooted)")
    return f"the first boot ended before the command started ({crash[:160]!r}; {first})"


def kvm_broken(reason: str) -> None:
    """Record that KVM failed a real guest (a 7-byte probe guest can run where
    a distribution kernel's decompressor stops with an emulation failure)."""
    _remember((False, reason))


def insnprof_plugin() -> str:
    """bench/insnprof/build's QEMU plugin (NODROP_INSNPROF=1; docs/bench.md,
    "Where the instructions go")."""
    r = subprocess.run([str(REPO / "bench" / "insnprof" / "build")],
                       capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"NODROP_INSNPROF: bench/insnprof/build failed: {r.stderr.strip()}")
    return r.stdout.strip()


def _boot_once(bzimage, rwdir, meta, console, use_kvm, timeout, boot_timeout, relay,
               cpus, memory, qemu_opts=(), root=None, shares=(),
               lockup_ends_boot=False) -> GuestResult:
    vng = vng_path()
    args = [vng, "--run", str(bzimage), "--force-9p", "--verbose",
            "--cpus", str(cpus), "--memory", memory, f"--rwdir={rwdir}",
            "--cwd", "/", "--exec", f"/bin/sh {shlex.quote(str(meta / 'guest.sh'))}"]
    if root is not None:        # guest paths = host paths, inside the other root
        args[9:12] = [f"--rwdir={rwdir}={rwdir}", "--cwd", str(root), "--root", str(root),
                      "--rw", *shares]
    if not use_kvm:
        args.insert(3, "--disable-kvm")
    if os.environ.get("NODROP_APPEND"):           # extra kernel command line (debugging)
        args[3:3] = ["--append", os.environ["NODROP_APPEND"]]
    if os.environ.get("NODROP_INSNPROF"):         # bench/insnprof: counts per block
        qemu_opts = [*qemu_opts, "-plugin", f"{insnprof_plugin()},arg=out={rwdir}/prof"]
    if qemu_opts:                                 # one word: vng pastes it into a shell line
        args[3:3] = [f"--qemu-opts={' '.join(qemu_opts)}"]
    # vng starts `virtme-run` through PATH: put the real interpreter dir first
    # so neither a pyenv shim nor another virtme-ng install is picked up.
    env = dict(os.environ, PATH=f"{Path(vng).parent}:{os.environ.get('PATH', '')}")
    say(f"booting {bzimage} ({'KVM' if use_kvm else 'TCG'}, {cpus} vCPUs, {memory}"
        f"{', ' + ' '.join(qemu_opts) if qemu_opts else ''})")
    t0 = time.monotonic()
    booted_at = None
    timed_out = False
    (meta / "vng-command").write_text(shlex.join(args) + "\n")
    with open(console, "wb") as con:      # QEMU reopens (truncates) it for the serial console
        proc = subprocess.Popen(args, stdout=con, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                cwd="/")
    tails = [_Tail(rwdir / "stdout", sys.stdout), _Tail(rwdir / "stderr", sys.stderr)]
    kvm_error = False
    try:
        rc_seen_at = None
        lockup_checked = t0
        while True:
            if relay:
                for t in tails:
                    t.pump()
            now = time.monotonic()
            if use_kvm and int(now - t0) % 2 == 0:
                # QEMU prints KVM_ERROR and pauses the guest for good (at any
                # time); a guest that KVM runs prints its banner within
                # seconds, and one that printed nothing after KVM_SILENT_S
                # hangs (seen with KASAN kernels here): do not wait for a
                # timeout, boot_and_run() runs it again with TCG
                kvm_error = (_console_tail_has(console, KVM_ERROR)
                             or (booted_at is None and now - t0 > KVM_SILENT_S
                                 and not _console_has_banner(console)))
                if kvm_error:
                    break
            if booted_at is None and (meta / "started").exists():
                booted_at = now
            if rc_seen_at is None and (meta / "rc").exists():
                rc_seen_at = now
            if proc.poll() is not None:
                break
            if ABORT.is_set():
                raise KeyboardInterrupt
            if rc_seen_at is not None and now - rc_seen_at > 15:
                break                                # guest did not power off: kill it
            if lockup_ends_boot and booted_at is None and now - lockup_checked >= 5:
                # a TCG vCPU that hangs in Debian's own boot (seen at a
                # patched static-branch site, 808 s) never recovers: end
                # this boot now, boot_and_run() boots the guest once more
                lockup_checked = now
                if _console_tail_has(console, SOFT_LOCKUP, 16384):
                    say("the guest reports a soft lockup before the command started; "
                        "ending this boot")
                    break
            if booted_at is None and now - t0 > boot_timeout:
                say(f"guest did not start the command within {boot_timeout:.0f}s")
                timed_out = True
                break
            if booted_at is not None and rc_seen_at is None and now - booted_at > timeout:
                say(f"guest command timed out after {timeout:.0f}s (NODROP_TIMEOUT)")
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        _kill_group(proc)
    if relay:
        for t in tails:
            t.pump()
    wall = time.monotonic() - t0
    if booted_at is None and (meta / "started").exists():
        booted_at = time.monotonic()
    rc = None
    try:
        rc = int((meta / "rc").read_text().strip())
    except (OSError, ValueError):
        pass
    uname = None
    try:
        uname = (meta / "uname").read_text().strip() or None
    except OSError:
        pass
    uptime = None
    try:
        uptime = float((meta / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return GuestResult(rc=rc, booted=booted_at is not None, uname=uname, kvm=use_kvm,
                       boot_seconds=(booted_at - t0) if booted_at else None,
                       guest_uptime=uptime, wall_seconds=wall, console=console,
                       timed_out=timed_out, kvm_error=kvm_error)


KVM_ERROR = b"KVM internal error"
CRASH_WORDS = ("Kernel panic", "Oops", "BUG:", "general protection", "Failed to mount")
SOFT_LOCKUP = b"watchdog: BUG: soft lockup"
KVM_SILENT_S = 20


def _console_has_banner(console: Path) -> bool:
    """Whether the guest kernel printed its banner (the first line it prints)."""
    try:
        with open(console, "rb") as f:
            return b"Linux version" in f.read(1 << 20)
    except OSError:
        return False


def _console_tail_has(console: Path, needle: bytes, size: int = 4096) -> bool:
    """Whether `needle` is in the last `size` bytes of the console (QEMU
    truncates the file when it starts, so offsets from before mean nothing;
    a KVM internal error is the last thing written: the guest is stopped)."""
    try:
        with open(console, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return needle in f.read()
    except OSError:
        return False


def report_failure(res: GuestResult, what: str) -> str:
    lines = tail_lines(res.console, 30)
    state = ("the guest did not boot / never started the command" if not res.booted
             else "the command timed out" if res.timed_out
             else "no exit code came back from the guest")
    return (f"{what}: {state}; last console lines ({res.console}):\n  "
            + "\n  ".join(lines))


def guest_env(extra: dict[str, str]) -> dict[str, str]:
    py = lab_python()
    path = os.pathsep.join([str(Path(py).parent), "/usr/local/sbin", "/usr/local/bin",
                            "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    base = {"PATH": path, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
            "NODROP_PYTHON": py, "LANG": "C.UTF-8"}
    base.update(extra)
    return base
