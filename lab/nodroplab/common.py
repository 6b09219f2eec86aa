"""Shared helpers: paths, messages, subprocess wrappers, hashing."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

LAB_DIR = Path(__file__).resolve().parent.parent          # <repo>/lab
REPO = LAB_DIR.parent                                       # <repo>
RESULTS = REPO / "results"
TOOLS_OUT = REPO / "tools" / "build"


class LabError(Exception):
    """A failure the user must act on: printed as one 'lab: ...' message."""

    def __init__(self, msg: str, rc: int = 1):
        super().__init__(msg)
        self.rc = rc


def cache_dir() -> Path:
    d = os.environ.get("NODROP_CACHE") or os.path.expanduser("~/.cache/nodrop")
    return Path(d).resolve()


def jobs() -> int:
    j = os.environ.get("NODROP_JOBS")
    return int(j) if j else (os.cpu_count() or 1)


def say(msg: str) -> None:
    """Progress line on stderr (stdout is reserved for results/paths)."""
    print(f"lab: {msg}", file=sys.stderr, flush=True)


def safe(s: str) -> str:
    """A Debian version as a path component: 1:6.12.1-1~deb12u1 -> 6.12.1-1_deb12u1."""
    return re.sub(r"[^A-Za-z0-9.+-]", "_", s)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None,
        check: bool = True, capture: bool = False, quiet: bool = False,
        log: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command. With log=, stdout+stderr go to that file (appended)."""
    if not quiet:
        say("$ " + shlex.join(str(c) for c in cmd))
    full_env = None
    if env is not None:
        full_env = dict(os.environ)
        full_env.update(env)
    if log is not None:
        with open(log, "ab") as lf:
            p = subprocess.run(cmd, cwd=cwd, env=full_env, stdout=lf,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    elif capture:
        p = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True,
                           text=True, stdin=subprocess.DEVNULL)
    else:
        p = subprocess.run(cmd, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        detail = ""
        if capture:
            detail = "\n" + ((p.stderr or "") + (p.stdout or "")).strip()[-2000:]
        elif log is not None:
            detail = f" (log: {log})"
        raise LabError(f"command failed (exit {p.returncode}): "
                       f"{shlex.join(str(c) for c in cmd)}{detail}")
    return p


def tail_lines(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return []
    data = data.replace("\r\n", "\n").replace("\r", "\n")
    return data.splitlines()[-n:]


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def require_root() -> None:
    if os.geteuid() != 0:
        print("lab: must run as root (apt-get, QEMU and the in-guest suite need it): "
              "re-run with sudo", file=sys.stderr)
        raise SystemExit(1)


class LabChild:
    """`python -m nodroplab <args>` in its own session (so its whole process
    group can be killed), output appended to `log`: the lab's background
    work (package preparation, kernel builds ahead of their rows)."""

    def __init__(self, args: list[str], log: Path, nice: int = 0):
        env = dict(os.environ, PYTHONPATH=str(LAB_DIR), PYTHONDONTWRITEBYTECODE="1")
        with open(log, "ab") as lf:
            self.proc = subprocess.Popen(
                [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m",
                 "nodroplab", *args], stdout=lf, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self) -> None:
        """Kill the process group if still running (interrupted or failed run)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=10)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
