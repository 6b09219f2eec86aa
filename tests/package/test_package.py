"""nodrop-dkms inside a Debian guest booted on Debian's own kernel.

Run by the lab's root-filesystem flavors (debian-12, debian-13; docs/dkms.md)
before the guest suite, with NODROP_EXPECT telling what the root filesystem
holds:

  package  nodrop-dkms installed: tun and vhost_net are loaded from
           /lib/modules/<kernel>/updates/dkms, carry the nodrop modinfo tag
           and a version naming this kernel's Linux version (the source
           they were made from) and the series,
           TUNGETFEATURES reports IFF_BACKPRESSURE, the ethtool switch is
           there and off by default, and the example udev rule turns it on
           (with fq_codel) for a new tun device once it is enabled.
  stock    the package was removed: the kernel's own modules, no switch,
           and no IFF_BACKPRESSURE before 7.3 (Debian's 7.3 has mainline's).

The behaviour tests themselves are tests/guest (selected files), which adapt
to TUNGETFEATURES; these tests make sure the kernel they ran on is the one
we meant.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import time

import pytest

# TUNGETFEATURES and the flag from the guest suite's helpers
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "guest"))
from tunlib import IFF_BACKPRESSURE, get_features  # noqa: E402

EXPECT = os.environ.get("NODROP_EXPECT", "package")
NAME = os.environ.get("NODROP_DKMS_NAME", "nodrop")
RULE = f"/usr/share/{NAME}-dkms/70-nodrop-backpressure.rules"
RULE_ON = "/etc/udev/rules.d/70-nodrop-backpressure.rules"


def sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    print(f"$ {cmd}\n{p.stdout}{p.stderr}", end="")
    if check and p.returncode:
        raise AssertionError(f"{cmd}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def mainline_flag() -> bool:
    """Stock kernels from 7.3 on have mainline's IFF_BACKPRESSURE (7.2 reverted it)."""
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (7, 3)


def linux_version() -> str:
    """The running kernel's Linux version X.Y.Z: Debian names its 6.12 and
    later kernels by it (6.12.118+deb13-amd64), Debian 12's 6.1 kernels by
    their ABI (6.1.0-41-amd64), whose `uname -v` says "Debian 6.1.192-2"."""
    m = re.search(r"\bDebian ([0-9]+\.[0-9]+\.[0-9]+)", platform.version())
    return m.group(1) if m else platform.release().split("+")[0].split("-")[0]


def loaded_version(mod: str) -> str | None:
    try:
        with open(f"/sys/module/{mod}/version") as f:
            return f.read().strip()
    except OSError:
        return None


@pytest.fixture(scope="module", autouse=True)
def modules_loaded():
    for mod in ("tun", "vhost_net"):
        sh(f"modprobe {mod}")


@pytest.mark.parametrize("mod", ["tun", "vhost_net"])
def test_module_origin(mod):
    kver = platform.release()
    fn = sh(f"modinfo -F filename {mod}").stdout.strip()
    tag = sh(f"modinfo -F {NAME} {mod}").stdout.strip()
    ver = loaded_version(mod)
    print(f"{mod}: {fn} tag={tag!r} loaded version={ver!r}")
    if EXPECT == "package":
        assert fn.startswith(f"/lib/modules/{kver}/updates/dkms/{mod}.ko"), fn
        assert tag.startswith(f"{NAME}-dkms "), f"no {NAME} modinfo tag in {fn}"
        # the module in memory is ours, not an in-tree one loaded earlier,
        # and says which Linux version it was made from: this kernel's
        up = linux_version()
        want = f"{NAME}{os.environ.get('NODROP_DKMS_VERSION', '')}+{up}+s"
        assert ver and want in ver, f"/sys/module/{mod}/version {ver!r}, expected {want}..."
        assert f"Linux {up}" in tag and " series " in tag, tag
    else:
        assert fn.startswith(f"/lib/modules/{kver}/kernel/drivers/"), fn
        assert not tag, f"stock expected, {fn} has {NAME} tag {tag!r}"
        assert not ver or NAME not in ver, ver


def test_features():
    feat = get_features()
    print(f"TUNGETFEATURES=0x{feat:04x}")
    if EXPECT == "package":
        assert feat & IFF_BACKPRESSURE, f"0x{feat:04x}: no IFF_BACKPRESSURE with {NAME}-dkms"
    elif mainline_flag():
        # Debian's own 7.3 has mainline's IFF_BACKPRESSURE (opt-in, no switch)
        assert feat & IFF_BACKPRESSURE, f"0x{feat:04x}: no IFF_BACKPRESSURE on stock {platform.release()}"
    else:
        assert not feat & IFF_BACKPRESSURE, f"0x{feat:04x}: IFF_BACKPRESSURE on a stock kernel"


def _flag(dev: str) -> bool | None:
    """The backpressure private flag: True/False, None if the driver has none."""
    out = sh(f"ethtool --show-priv-flags {dev}", check=False).stdout
    for line in out.splitlines():
        k, _, v = line.partition(":")
        if k.strip() == "backpressure":
            return v.strip() == "on"
    return None


def _wait_flag(dev: str, timeout: float = 30) -> bool | None:
    end = time.monotonic() + timeout
    while True:
        f = _flag(dev)
        if f or time.monotonic() > end:
            return f
        time.sleep(0.5)


def test_switch_off_by_default():
    dev = "tunndpkg0"
    sh(f"ip tuntap add mode tun name {dev}")
    try:
        if shutil.which("udevadm"):
            sh("udevadm settle -t 30", check=False)
        f = _flag(dev)
        if EXPECT == "package":
            assert f is False, f"{dev}: backpressure flag {f}, expected present and off"
        else:
            assert f is None, f"{dev}: stock tun has a backpressure flag ({f})"
    finally:
        sh(f"ip link del {dev}", check=False)


def test_udev_rule_example():
    if EXPECT != "package":
        # apt-get remove takes the example with it; an enabled copy is the
        # admin's and stays
        assert not os.path.exists(RULE), f"{RULE} left behind by apt-get remove"
        return
    if not shutil.which("udevadm") or not os.path.exists("/run/udev/control"):
        pytest.skip("no running udevd in this guest")
    assert os.path.exists(RULE), f"{RULE} missing from the package"
    assert not os.path.exists(RULE_ON), f"{RULE_ON}: the rule must not be enabled by default"
    shutil.copy(RULE, RULE_ON)
    dev = "tapndpkg0"
    try:
        sh("udevadm control --reload")
        sh(f"ip tuntap add mode tap name {dev}")
        sh("udevadm settle -t 30", check=False)
        f = _wait_flag(dev)
        assert f is True, f"udev rule did not turn backpressure on ({f})"
        q = sh(f"tc qdisc show dev {dev} root").stdout
        assert "fq_codel" in q, f"udev rule did not set fq_codel: {q}"
    finally:
        sh(f"ip link del {dev}", check=False)
        os.unlink(RULE_ON)
        sh("udevadm control --reload", check=False)
