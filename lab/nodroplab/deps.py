"""`deps`: host packages (apt) and Python packages (pip) the lab needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .common import LabError, cache_dir, require_root, say

# Debian 12 packages. Kernel build: gcc make flex bison bc libelf-dev libssl-dev
# perl cpio kmod xz-utils zstd ccache git. Boot: qemu-system-x86 seabios (q35
# BIOS) busybox-static udev file (virtme-ng). Guest suite: iproute2 ethtool iperf3.
APT_PACKAGES = [
    "gcc", "make", "git", "perl", "flex", "bison", "bc", "libelf-dev", "libssl-dev",
    "cpio", "kmod", "xz-utils", "zstd", "ccache",
    "qemu-system-x86", "seabios", "busybox-static", "udev", "file",
    "iproute2", "ethtool", "iperf3", "iputils-ping", "util-linux",
    "openvpn",                  # tests/guest/test_operator.py: an unmodified program
    "python3-pip",
]

# `make dkms` / `make package` / the debian-* root-filesystem flavors
# (docs/dkms.md): Debian's packaging tools and debootstrap. Only installed
# by those commands.
PACKAGE_APT = ["debhelper", "dh-dkms", "dpkg-dev", "debootstrap",
               "debian-archive-keyring", "git"]

# Host-side Python packages of the benchmark report (plots)
BENCH_REQUIREMENTS = Path(__file__).resolve().parents[2] / "bench" / "requirements.txt"

VIRTME_NG = "virtme-ng==1.42"
# What the lab's interpreter needs (vng, the in-guest pytest; PyYAML: ynl,
# which the 7.3 series' selftest tun_bp_qstats.py uses in the guest):
# distribution, exact version or None, pip requirement
PY_NEEDS = [("virtme-ng", "1.42", VIRTME_NG), ("pytest", None, "pytest"),
            ("PyYAML", None, "PyYAML")]


def _dpkg_missing(pkgs: list[str]) -> list[str]:
    p = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\n", *pkgs],
                       capture_output=True, text=True)
    installed = {ln.split()[0] for ln in p.stdout.splitlines()
                 if ln.endswith(" installed")}
    return [x for x in pkgs if x not in installed]


def _apt_install(pkgs: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs],
                          env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def ensure_apt(pkgs: list[str]) -> None:
    missing = _dpkg_missing(pkgs)
    if not missing:
        return
    say(f"installing host packages: {' '.join(missing)}")
    if _apt_install(missing).returncode != 0:
        say("apt-get install failed; running apt-get update and retrying")
        subprocess.run(["apt-get", "update", "-q"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL)
        if _apt_install(missing).returncode != 0:
            failed = []
            for pkg in missing:
                p = _apt_install([pkg])
                if p.returncode != 0:
                    err = [ln for ln in p.stderr.splitlines() if ln.startswith("E:")]
                    failed.append(f"{pkg} ({err[0] if err else 'apt-get exit %d' % p.returncode})")
            if failed:
                raise LabError("Debian registry (apt): could not install " + "; ".join(failed))
    still = _dpkg_missing(missing)
    if still:
        raise LabError("Debian registry (apt): still missing after install: " + " ".join(still))


# --- Python side: the interpreter that runs vng and the in-guest pytest -----

def _venv_python() -> Path:
    return cache_dir() / "venv" / "bin" / "python3"


def _py_missing(python: str) -> list[str]:
    """The pip requirements of PY_NEEDS that @python lacks (all of them if
    it does not run), found in one run of it."""
    code = ("import importlib.metadata as m\n"
            f"for dist, want, req in {PY_NEEDS!r}:\n"
            "    try:\n"
            "        ok = want in (None, m.version(dist))\n"
            "    except m.PackageNotFoundError:\n"
            "        ok = False\n"
            "    if not ok:\n"
            "        print(req)\n")
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True)
    except OSError:
        return [req for _, _, req in PY_NEEDS]
    if p.returncode != 0:
        return [req for _, _, req in PY_NEEDS]
    return p.stdout.split()


def _py_ready(python: str) -> bool:
    return not _py_missing(python)


_LAB_PYTHON: str | None = None


def lab_python() -> str:
    """Absolute path of the Python that runs vng and pytest (also in the guest).

    NODROP_PYTHON wins; else the interpreter running the lab (symlinks and
    the pyenv shim resolved, so the guest sees a real binary); else the lab's
    own venv under $NODROP_CACHE (created by `deps` on PEP 668 systems)."""
    global _LAB_PYTHON
    if _LAB_PYTHON is None:
        _LAB_PYTHON = _find_lab_python()
    return _LAB_PYTHON


def _find_lab_python() -> str:
    env = os.environ.get("NODROP_PYTHON")
    if env:
        return env
    cur = sys.executable
    if sys.prefix == sys.base_prefix:          # not a venv: resolve symlinks
        cur = os.path.realpath(cur)
    if _py_ready(cur):
        return cur
    venv = _venv_python()
    if venv.exists() and _py_ready(str(venv)):
        return str(venv)
    return cur


def vng_path() -> str:
    cand = Path(lab_python()).parent / "vng"
    if cand.exists():
        return str(cand)
    w = shutil.which("vng")
    if not w:
        raise LabError("vng (virtme-ng) not found: run `make deps` (PyPI: pip install virtme-ng==1.42)")
    return w


def _pip_install(python: str, pkgs: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", "install", "-q", *pkgs],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)


def ensure_python() -> str:
    global _LAB_PYTHON
    _LAB_PYTHON = None
    py = lab_python()
    want = _py_missing(py)
    if not want:
        return py
    say(f"pip installing {' '.join(want)} for {py}")
    p = _pip_install(py, want)
    if p.returncode != 0 and "externally-managed-environment" in (p.stderr + p.stdout):
        venv = _venv_python()
        say(f"{py} is externally managed (PEP 668): using a lab venv {venv.parent.parent}")
        ensure_apt(["python3-venv"])
        if not venv.exists():
            r = subprocess.run([sys.executable, "-m", "venv", str(venv.parent.parent)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise LabError(f"cannot create venv: {r.stderr.strip()[-500:]}")
        py = str(venv)
        p = _pip_install(py, [req for _, _, req in PY_NEEDS])
    if p.returncode != 0:
        err = (p.stderr or p.stdout).strip().splitlines()
        raise LabError(f"PyPI (pip): could not install {' '.join(want)}: "
                       f"{err[-1] if err else 'pip exit %d' % p.returncode}")
    if not _py_ready(py):
        raise LabError(f"PyPI (pip): {' '.join(want)} installed but not importable by {py}")
    _LAB_PYTHON = py
    return py


def deps() -> str:
    require_root()
    ensure_apt(APT_PACKAGES)
    py = ensure_python()
    if BENCH_REQUIREMENTS.exists():
        p = subprocess.run([py, "-m", "pip", "install", "-q", "-r", str(BENCH_REQUIREMENTS)],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            err = (p.stderr or p.stdout).strip().splitlines()
            raise LabError(f"PyPI (pip): could not install {BENCH_REQUIREMENTS.name} "
                           f"({BENCH_REQUIREMENTS.read_text().split()}): {err[-1] if err else p.returncode}")
    say(f"deps ok (python for vng and the guest: {py})")
    return py
