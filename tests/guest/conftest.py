"""Fixtures for the NODROP guest suite.

* Every test runs in a fresh network namespace (`env` fixture): the pytest
  process unshare()s a new netns, and setns()es back to the original one
  afterwards. Processes it starts inherit the namespace.
* Kernel log lines written during a test that show a kernel bug (BUG, WARNING,
  Oops, "asks to queue packet" = a stopped queue under noqueue) fail the test.
* A per-test alarm (NODROP_TEST_TIMEOUT seconds, default 1200) turns a hang
  into a failure instead of eating the lab's whole time budget.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import socket
import subprocess

import pytest

import tunlib

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

SPLAT = re.compile(r"BUG:|WARNING:|Oops|general protection|Call Trace|"
                   r"asks to queue packet|soft lockup|hung_task|RCU stall|"
                   r"refcount_t:|use-after-free|KASAN|UBSAN|kmemleak",
                   re.IGNORECASE)


def _tools_dir() -> str:
    d = os.environ.get("NODROP_TOOLS")
    if d:
        return d
    d = os.path.join(REPO, "tools", "build")
    # convenience for a developer run: build the helpers if needed
    subprocess.run(["make", "-s", "-C", os.path.join(REPO, "tools")], check=True)
    return d


@pytest.fixture(scope="session")
def tools() -> tunlib.Tools:
    d = _tools_dir()
    for prog in ("udpburst", "tunreader"):
        p = os.path.join(d, prog)
        if not os.access(p, os.X_OK):
            pytest.exit(f"missing helper {p}: run `make -C tools OUT={d}`", 3)
    return tunlib.Tools(d)


@pytest.fixture(scope="session")
def features() -> int:
    return tunlib.get_features()


@pytest.fixture(scope="session")
def bp(features) -> bool:
    return bool(features & tunlib.IFF_BACKPRESSURE)


@pytest.fixture(scope="session", autouse=True)
def flow_hash_warm_up():
    """One UDP datagram through fq_codel on a tun before the first test, in
    a namespace of its own. The first flow hash after boot turns the
    DO_ONCE static branch in __skb_get_hash_net() off with text_poke_bp();
    under QEMU TCG a vCPU running that site during the poke once died on
    the transient int3 (docs/lab.md, "TCG flake"). Here nothing else runs on
    the other vCPU. Best effort: a failure here is the tests' to report."""
    orig = os.open("/proc/self/ns/net", os.O_RDONLY)
    tun = None
    try:
        tunlib.unshare_net()
        tun = tunlib.Tun("ndwarm0", tunlib.IFF_TUN | tunlib.IFF_NO_PI)
        tunlib.setup_ip("ndwarm0", tap=False)
        tunlib.set_fq_codel("ndwarm0")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
            sk.sendto(b"warm-up", (tunlib.PEER_IP, 9))
    except (OSError, RuntimeError) as e:
        print(f"flow hash warm-up failed: {e}")
    finally:
        if tun is not None:
            tun.close()
        tunlib.setns(orig)
        os.close(orig)
    yield


def pytest_report_header(config):
    try:
        feat = tunlib.get_features()
        f = f"TUNGETFEATURES=0x{feat:04x} ({tunlib.flag_names(feat)}) " \
            f"backpressure={'yes' if feat & tunlib.IFF_BACKPRESSURE else 'no'}"
    except OSError as e:
        f = f"TUNGETFEATURES failed: {e}"
    return [f"NODROP: kernel {platform.release()} "
            f"flavor-label={os.environ.get('NODROP_FLAVOR', '-')} "
            f"cpus={tunlib.cpus()}", f"NODROP: {f}"]


class _KmsgWatch:
    def __init__(self):
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            self.fd = -1

    def new_lines(self) -> list[str]:
        out = []
        if self.fd < 0:
            return out
        while True:
            try:
                rec = os.read(self.fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == 32:  # EPIPE: records overwritten, go on
                    continue
                break
            if not rec:
                break
            text = rec.decode(errors="replace")
            msg = text.split(";", 1)[1] if ";" in text else text
            out.append(msg.splitlines()[0] if msg else "")
        os.close(self.fd)
        self.fd = -1
        return out


@pytest.fixture
def env(tools, bp, request):
    """A fresh network namespace plus an Env to create devices/processes."""
    timeout = int(os.environ.get("NODROP_TEST_TIMEOUT", "1200"))

    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded NODROP_TEST_TIMEOUT={timeout}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout)
    kmsg = _KmsgWatch()
    orig = os.open("/proc/self/ns/net", os.O_RDONLY)
    tunlib.unshare_net()
    e = tunlib.Env(tools, bp)
    try:
        tunlib.sh("ip link set dev lo up")
        # no IPv6 router solicitations / MLD reports in our rings
        for conf in ("all", "default"):
            p = f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6"
            if os.path.exists(p):
                tunlib.write_file(p, "1")
        yield e
    finally:
        signal.alarm(0)
        try:
            e.cleanup()
        finally:
            tunlib.setns(orig)
            os.close(orig)
            signal.signal(signal.SIGALRM, old)
    lines = kmsg.new_lines()
    bad = [l for l in lines if SPLAT.search(l)]
    allowed = [l for l in bad if any(a in l for a in e.kmsg_allowed)]
    bad = [l for l in bad if l not in allowed]
    if allowed:
        print(f"RECORDED kernel messages ({len(allowed)}):\n" + "\n".join(allowed[:20]))
    res = os.environ.get("NODROP_RESULTS")
    if lines and res and os.path.isdir(res):
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
        with open(os.path.join(res, f"kmsg-{name}.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if bad:
        pytest.fail("kernel log during the test shows a problem:\n" +
                    "\n".join(bad[:40]), pytrace=False)
