"""Helpers for the NODROP guest test suite.

Everything a test needs to drive TUN/TAP devices from Python 3.11 with no
third-party package: the TUN ioctls, network-namespace handling, counters
(/proc/net/dev, `tc -s -j qdisc`), and wrappers around the C helpers in
tools/ (udpburst, tunreader), which do the per-packet work because Python is
slow under QEMU TCG.

Feature detection is strictly `TUNGETFEATURES & IFF_BACKPRESSURE`
(`has_backpressure()`); nothing here looks at the kernel version or at
$NODROP_FLAVOR.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import select
import shlex
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass

# --- uapi: include/uapi/linux/if_tun.h --------------------------------------
IFF_TUN = 0x0001
IFF_TAP = 0x0002
IFF_NAPI = 0x0010
IFF_NAPI_FRAGS = 0x0020
IFF_NO_CARRIER = 0x0040
IFF_BACKPRESSURE = 0x0080
IFF_MULTI_QUEUE = 0x0100
IFF_ATTACH_QUEUE = 0x0200
IFF_DETACH_QUEUE = 0x0400
IFF_PERSIST = 0x0800
IFF_NO_PI = 0x1000
IFF_ONE_QUEUE = 0x2000
IFF_VNET_HDR = 0x4000
IFF_TUN_EXCL = 0x8000
# Not defined by any of the kernels we test (6.12, 6.12+NODROP, 7.3).
IFF_UNDEFINED_BIT = 0x0008

FLAG_NAMES = {
    IFF_TUN: "TUN", IFF_TAP: "TAP", IFF_NAPI: "NAPI",
    IFF_NAPI_FRAGS: "NAPI_FRAGS", IFF_NO_CARRIER: "NO_CARRIER",
    IFF_BACKPRESSURE: "BACKPRESSURE", IFF_MULTI_QUEUE: "MULTI_QUEUE",
    IFF_PERSIST: "PERSIST", IFF_NO_PI: "NO_PI", IFF_ONE_QUEUE: "ONE_QUEUE",
    IFF_VNET_HDR: "VNET_HDR", IFF_TUN_EXCL: "TUN_EXCL",
}


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord("T") << 8) | nr


_IOW, _IOR = 1, 2
TUNSETIFF = _ioc(_IOW, 202, 4)
TUNSETPERSIST = _ioc(_IOW, 203, 4)
TUNGETFEATURES = _ioc(_IOR, 207, 4)
TUNGETIFF = _ioc(_IOR, 210, 4)
TUNGETVNETHDRSZ = _ioc(_IOR, 215, 4)
TUNSETVNETHDRSZ = _ioc(_IOW, 216, 4)
TUNSETQUEUE = _ioc(_IOW, 217, 4)

IFNAMSIZ = 16
CLONE_NEWNET = 0x40000000

# Addresses of the test "peer" behind the device. 198.18.0.0/15 is the
# benchmarking range (RFC 2544); every packet stays inside the test's own
# network namespace, it only ever reaches our reader's file descriptor.
LOCAL_IP = "198.18.0.1"
PEER_IP = "198.18.0.2"
PREFIX = 24
PEER_MAC = "02:00:00:00:00:02"
UDP_PORT = 9000

# fq_codel whose AQM cannot act within a test run: packets wait in a
# paused-reader test for seconds (much longer under TCG), and a codel drop
# would depend on speed. Flow queueing and backlog accounting are unchanged.
FQ_CODEL_ARGS = "fq_codel limit 10240 target 5s interval 60s"
# Used where the kernel has no fq_codel (this development host): a plain
# FIFO holds packets the same way for what these tests observe.
FQ_CODEL_FALLBACK = "pfifo limit 10240"

_libc = ctypes.CDLL(None, use_errno=True)


def flag_names(flags: int) -> str:
    names = [n for b, n in sorted(FLAG_NAMES.items()) if flags & b]
    rest = flags & ~sum(FLAG_NAMES)
    if rest:
        names.append(hex(rest))
    return "|".join(names) or "0"


# --- namespaces ---------------------------------------------------------------
def unshare_net() -> None:
    if _libc.unshare(CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    if _libc.setns(fd, nstype) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


# --- shell ---------------------------------------------------------------------
def log(msg: str) -> None:
    print(msg, flush=True)


def sh(cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a shell command (ip, tc, ...) in the current namespace."""
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {cmd}\n"
                           f"stdout: {r.stdout}\nstderr: {r.stderr}")
    return r


def write_file(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


# --- TUN ioctls ----------------------------------------------------------------
def _ifreq(name: str, flags: int) -> bytes:
    return struct.pack("16sH22x", name.encode(), flags & 0xFFFF)


def get_features(fd: int | None = None) -> int:
    """TUNGETFEATURES (works on a fresh, unattached /dev/net/tun fd)."""
    own = fd is None
    if own:
        fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, TUNGETFEATURES, buf, True)
        return struct.unpack("I", buf)[0]
    finally:
        if own:
            os.close(fd)


def has_backpressure() -> bool:
    """The one and only feature test: TUNGETFEATURES reports 0x0080."""
    return bool(get_features() & IFF_BACKPRESSURE)


# --- what the flavor must support (lab/flavors.toml `features`) ----------------
# The lab passes the booted flavor's declared features in NODROP_FEATURES
# (space-separated). A test that finds the kernel without something it needs
# calls lacks(): the test skips (or xfails) with a "[lacks <feature>]" tag the
# lab matches against the declaration, and fails outright when the flavor
# declares that feature. Outside the lab (no NODROP_FEATURES) the kernel decides.
FEATURES = ("backpressure", "switch", "qstats", "bql", "bql-sysfs", "nodrop",
            "vhost-net", "pktgen", "smp", "xdp", "kselftest", "kselftest-qstats",
            "openvpn", "unpriv-tools")


def declared_features() -> set[str] | None:
    v = os.environ.get("NODROP_FEATURES")
    if v is None:
        return None
    feats = set(v.split())
    unknown = feats - set(FEATURES)
    if unknown:
        raise RuntimeError(f"NODROP_FEATURES names unknown features {sorted(unknown)}; "
                           f"known: {' '.join(FEATURES)}")
    return feats


def declares(feature: str) -> bool:
    """The booted flavor says it must support `feature` (False outside the lab)."""
    assert feature in FEATURES, feature
    return feature in (declared_features() or ())


def lacks(feature: str, why: str, *, xfail: bool = False):
    """This kernel lacks `feature`: skip (xfail=True: record an expected
    failure) tagged "[lacks <feature>]", or fail if the flavor declares it."""
    import pytest    # tunlib is also imported by bench code without pytest
    assert feature in FEATURES, feature
    if declares(feature):
        pytest.fail(f"the flavor declares '{feature}' but this kernel lacks it: {why}",
                    pytrace=False)
    (pytest.xfail if xfail else pytest.skip)(f"[lacks {feature}] {why}")


class Tun:
    """One /dev/net/tun file descriptor attached to a device (one queue)."""

    def __init__(self, name: str, flags: int, vnet_hdr_sz: int | None = None):
        self.requested = flags
        self.fd = os.open("/dev/net/tun", os.O_RDWR)
        try:
            self.set_iff(name, flags)
        except OSError:
            os.close(self.fd)
            self.fd = -1
            raise
        if vnet_hdr_sz is not None:
            fcntl.ioctl(self.fd, TUNSETVNETHDRSZ, struct.pack("i", vnet_hdr_sz))

    def set_iff(self, name: str, flags: int) -> None:
        """TUNSETIFF on this file: creates (or attaches to) the device
        `name`; again after its device was deleted, a new one."""
        r = fcntl.ioctl(self.fd, TUNSETIFF, _ifreq(name, flags))
        self.name = r[:IFNAMSIZ].split(b"\0", 1)[0].decode()

    def get_iff(self) -> int:
        r = fcntl.ioctl(self.fd, TUNGETIFF, bytes(40))
        return struct.unpack("H", r[16:18])[0]

    def vnet_hdr_sz(self) -> int:
        buf = bytearray(4)
        fcntl.ioctl(self.fd, TUNGETVNETHDRSZ, buf, True)
        return struct.unpack("i", buf)[0]

    def set_queue(self, attach: bool) -> None:
        flags = IFF_ATTACH_QUEUE if attach else IFF_DETACH_QUEUE
        fcntl.ioctl(self.fd, TUNSETQUEUE, _ifreq("", flags))

    def set_persist(self, on: bool) -> None:
        fcntl.ioctl(self.fd, TUNSETPERSIST, 1 if on else 0)

    def set_nonblocking(self) -> None:
        fl = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --- counters ------------------------------------------------------------------
def dev_stats(dev: str) -> dict:
    """Device counters from /proc/net/dev (follows the caller's netns;
    /sys/class/net shows the namespace sysfs was mounted in, not ours)."""
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, rest = line.split(":", 1)
            if name.strip() == dev:
                v = [int(x) for x in rest.split()]
                return {"rx_bytes": v[0], "rx_packets": v[1], "rx_dropped": v[3],
                        "tx_bytes": v[8], "tx_packets": v[9], "tx_errors": v[10],
                        "tx_dropped": v[11]}
    raise KeyError(f"{dev} not in /proc/net/dev")


def tx_dropped(dev: str) -> int:
    return dev_stats(dev)["tx_dropped"]


def qdiscs(dev: str) -> list[dict]:
    out = sh(f"tc -s -j qdisc show dev {dev}").stdout.strip()
    # iproute2 6.1 prints multiq's options as bare text ({bands 2/256 }),
    # which is not JSON; a valid object without a quote is empty anyway
    out = re.sub(r'"options":\{[^"{}]*\}', '"options":{}', out)
    return json.loads(out) if out else []


def root_qdisc(dev: str) -> dict:
    for q in qdiscs(dev):
        if q.get("root"):
            return q
    raise KeyError(f"no root qdisc on {dev}")


def qdisc_by_parent(dev: str, parent: str) -> dict:
    for q in qdiscs(dev):
        if q.get("parent") == parent:
            return q
    raise KeyError(f"no qdisc with parent {parent} on {dev}")


def qsummary(q: dict) -> str:
    return (f"{q.get('kind')} sent={q.get('packets', 0)}p "
            f"backlog={q.get('qlen', 0)}p/{q.get('backlog', 0)}b "
            f"drops={q.get('drops', 0)} requeues={q.get('requeues', 0)}")


def qdisc_totals(dev: str) -> dict:
    """Drops/backlog over the whole tree. Classless roots and mq (whose
    dump already aggregates its children) report totals in the root."""
    q = root_qdisc(dev)
    return {"kind": q.get("kind"), "packets": q.get("packets", 0),
            "drops": q.get("drops", 0), "qlen": q.get("qlen", 0),
            "backlog": q.get("backlog", 0)}


def set_qdisc(dev: str, spec: str, parent: str = "root") -> None:
    where = "root" if parent == "root" else f"parent {parent}"
    sh(f"tc qdisc replace dev {dev} {where} {spec}")


_fq_codel_ok: bool | None = None


def set_fq_codel(dev: str, parent: str = "root") -> str:
    """Attach fq_codel (FQ_CODEL_ARGS); fall back to pfifo only when this
    kernel does not know fq_codel. Returns the spec actually used."""
    global _fq_codel_ok
    if _fq_codel_ok is not False:
        where = "root" if parent == "root" else f"parent {parent}"
        r = sh(f"tc qdisc replace dev {dev} {where} {FQ_CODEL_ARGS}", check=False)
        if r.returncode == 0:
            _fq_codel_ok = True
            return FQ_CODEL_ARGS
        if "unknown" not in (r.stderr + r.stdout).lower():
            raise RuntimeError(f"tc fq_codel failed: {r.stderr}")
        _fq_codel_ok = False
        log("NOTICE: this kernel has no fq_codel; using "
            f"'{FQ_CODEL_FALLBACK}' instead")
    set_qdisc(dev, FQ_CODEL_FALLBACK, parent)
    return FQ_CODEL_FALLBACK


def drained(dev: str, readers, stall_s: float = 60.0) -> dict:
    """The qdisc's backlog reached 0, then every reader found its queue
    empty: nothing sent before is still on its way. Returns the root qdisc."""
    q = wait_backlog_zero(dev, stall_s=stall_s)
    for r in readers:
        r.empty()
    return q


# A marker: one datagram of udpburst's format with its own id, sent behind
# everything else. qdisc (empty when it is sent), ring, vhost-net's batch and
# the RX buffers are FIFO for one queue, so once a consumer got the marker,
# everything sent before it has been received, dropped (counted) or freed by
# a backend change: counts read then are final. Tests use ids 1-10 and 15.
MARK_ID = 14


def traffic(st: dict, key: str) -> int:
    """A reader's counter `key` (pkts, ours, idK) without the markers."""
    if key.startswith("id"):
        return st["per_id"][int(key[2:])]
    return st[key] - (st["per_id"][MARK_ID] if key in ("pkts", "ours") else 0)


def send_marker(reader: "Reader", dst: str = PEER_IP) -> None:
    """One marker datagram (id MARK_ID, the reader's next sequence number,
    so that the reader sees no duplicate)."""
    seq = getattr(reader, "marks", 0)
    reader.marks = seq + 1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(probe_payload(MARK_ID, seq), (dst, UDP_PORT))


def vhost_drained(dev: str, rx: "VhostRx", stall_s: float = 60.0) -> dict:
    """drained() for a vhost-net consumer, which cannot read until EAGAIN
    (its worker takes up to 64 entries at a time into a private buffer):
    the qdisc's backlog reached 0, the tap's ring is empty (ring_empty()),
    then a marker sent now reached the consumer. The marker meets an empty
    qdisc and a ring with room (no tail drop, on any kernel), and arrives
    behind everything that was in the ring or in vhost-net's batch. The
    consumer must be attached and running. Returns its counters."""
    q = wait_backlog_zero(dev, stall_s=stall_s)
    wait_ring(rx.tun, True, f"draining {dev} into {rx.label}",
              progress=lambda: rx.stat()["pkts"], stall_s=stall_s)
    base = rx.stat()["per_id"][MARK_ID]
    d0 = tx_dropped(dev)
    send_marker(rx)
    r = rx.wait(f"id{MARK_ID}", base + 1, stall_s=stall_s)
    assert r["result"] == "ok", (
        f"STALL: the marker sent behind everything else never reached {rx.label} "
        f"({stall_s:.0f}s without a packet): {r}; qdisc before it {q}, now "
        f"{qsummary(root_qdisc(dev))}; tx_dropped since it {tx_dropped(dev) - d0}")
    return rx.stat()


def wait_tx_settled(dev: str, stall_s: float = 60.0, since: dict | None = None) -> dict:
    """After a burst into a paused reader of a single-queue device: wait
    until the split between the qdisc and the ring is final, i.e. the qdisc
    is empty or the queue is stopped: by the ring (qstats: more stops than
    wakes) or by BQL (byte_queue_limits: more in flight than the limit).
    Returns the root qdisc's totals. Without either counter only an empty
    qdisc ends the wait, unless `since` is given: a root qdisc dump from
    before the burst (root_qdisc()/nl_root_qdisc()); a requeue counted
    after it also ends the wait. The qdisc requeues a packet it dequeued
    for a queue it then finds stopped, so a requeue since `since` says the
    queue stopped after it, and with no reader nothing wakes it. A burst's
    first stop shows one on every kernel measured (docs/tests.md: "qdisc
    sent 26, requeues 1"); a later stop need not: a single-queue qdisc does
    not dequeue for a queue it already finds stopped."""
    end = time.monotonic() + stall_s
    while True:
        q = qdisc_totals(dev)
        if q["qlen"] == 0:
            return q
        st, b = qstats(dev), bql(dev)
        if (st is not None and any(c["stop"] > c["wake"] for c in st["queues"].values())) \
                or (b is not None and b["inflight"] > b["limit"]):
            return qdisc_totals(dev)
        rq = nl_root_qdisc(dev).get("requeues", 0) if since is not None else None
        if rq is not None and rq > since.get("requeues", 0):
            return qdisc_totals(dev)
        if time.monotonic() > end:
            raise AssertionError(f"{dev}: the qdisc holds {q['qlen']}p but the queue is "
                                 f"not stopped after {stall_s:.0f}s (qstats {st}, bql {b}, "
                                 f"requeues {rq} since {since and since.get('requeues', 0)})")
        time.sleep(0.05)


def wait_for(what: str, state, done, stall_s: float = 60.0, poll_s: float = 0.05):
    """Poll state() until done(state) is true and return that state. Any
    change of state() is progress; a state that has not changed for stall_s
    while done() is still false is a STALL, reported with that state."""
    last, since = None, time.monotonic()
    while True:
        st = state()
        if done(st):
            return st
        if st != last:
            last, since = st, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AssertionError(f"STALL: {what}: nothing changed for {stall_s:.0f}s; "
                                 f"state {st}")
        time.sleep(poll_s)


def ring_empty(tun: "Tun") -> bool:
    """The ring of tun's queue holds nothing: poll() on the queue's fd
    (tun_chr_poll() reports POLLIN exactly while its ring is not empty),
    which consumes nothing, so it also works while vhost-net or another
    process reads that queue."""
    p = select.poll()
    p.register(tun.fd, select.POLLIN)
    ev = dict(p.poll(0)).get(tun.fd, 0)
    if ev & (select.POLLERR | select.POLLNVAL):
        raise AssertionError(f"poll() on {tun.name}'s queue: revents {ev:#x} (detached?)")
    return not ev & select.POLLIN


def wait_ring(tun: "Tun", empty: bool, what: str, progress=lambda: None,
              stall_s: float = 60.0) -> None:
    """Wait until the ring of tun's queue is empty (or, empty=False, holds
    something); progress() (e.g. a consumer's count) changing resets the
    stall limit."""
    wait_for(f"{what}: ring of {tun.name} {'still holds packets' if empty else 'stays empty'}",
             lambda: (ring_empty(tun), progress()), lambda st: st[0] == empty,
             stall_s=stall_s)


def wait_backlog_zero(dev: str, stall_s: float = 60.0, poll_s: float = 0.2,
                      parent: str | None = None) -> dict:
    """Wait until the whole qdisc tree of dev (or the qdisc below `parent`)
    is empty. Fails only when the backlog has not shrunk for stall_s seconds
    (a stall, not slowness)."""
    best = None
    last_change = time.monotonic()
    while True:
        t = qdisc_totals(dev) if parent is None else qdisc_by_parent(dev, parent)
        if t["qlen"] == 0:
            return t
        if best is None or t["qlen"] < best:
            best = t["qlen"]
            last_change = time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            raise AssertionError(
                f"STALL: qdisc backlog on {dev} {parent or ''} stuck at {t['qlen']}p for "
                f"{stall_s:.0f}s ({t}); tx_dropped={tx_dropped(dev)}")
        time.sleep(poll_s)


def ethtool_priv_flags(dev: str) -> dict[str, bool]:
    r = sh(f"ethtool --show-priv-flags {dev}", check=False)
    flags = {}
    for line in r.stdout.splitlines():
        if ":" in line and not line.lower().startswith("private flags"):
            k, v = line.split(":", 1)
            flags[k.strip()] = v.strip() == "on"
    return flags


def has_priv_flag(dev: str, name: str) -> bool:
    """The device lists the ethtool private flag `name` (on or off)."""
    return name in ethtool_priv_flags(dev)


def set_priv_flag(dev: str, name: str, on: bool,
                  check: bool = True, prefix: str = "") -> subprocess.CompletedProcess:
    """`ethtool --set-priv-flags dev name on|off`, optionally run through a
    command prefix (e.g. "unshare -U -r"). check=False returns the result
    of a refused change instead of raising."""
    return sh(f"{prefix} ethtool --set-priv-flags {dev} {name} {'on' if on else 'off'}".strip(),
              check=check)


# --- per-queue statistics (netdev netlink family, qstats-get) ---------------------
# uapi values from include/uapi/linux/netdev.h and genetlink.h (stable ABI)
_GENL_ID_CTRL, _CTRL_CMD_GETFAMILY = 0x10, 3
_CTRL_ATTR_FAMILY_ID, _CTRL_ATTR_FAMILY_NAME = 1, 2
_NETDEV_CMD_QSTATS_GET = 12
_QSTATS_IFINDEX, _QSTATS_QUEUE_TYPE, _QSTATS_QUEUE_ID, _QSTATS_SCOPE = 1, 2, 3, 4
_QSTATS_TX = {33: "stop", 34: "wake"}
_NLM_F_REQUEST, _NLM_F_DUMP, _NLMSG_ERROR, _NLMSG_DONE = 1, 0x300, 2, 3


def nla(atype: int, payload: bytes) -> bytes:
    a = struct.pack("=HH", 4 + len(payload), atype) + payload
    return a + b"\0" * (-len(a) % 4)


def _nla_parse(buf: bytes) -> dict[int, bytes]:
    attrs, off = {}, 0
    while off + 4 <= len(buf):
        ln, at = struct.unpack_from("=HH", buf, off)
        if ln < 4:
            break
        attrs[at & 0x3fff] = buf[off + 4:off + ln]
        off += (ln + 3) & ~3
    return attrs


def _nl_request(sk: socket.socket, mtype: int, body: bytes, hdr_len: int,
                dump: bool, headers: bool = False) -> list:
    """One netlink request; the attributes of each reply, which start
    hdr_len bytes into its payload (the family's fixed header); with
    headers, (fixed header bytes, attributes) per reply."""
    flags = _NLM_F_REQUEST | (_NLM_F_DUMP if dump else 0)
    sk.send(struct.pack("=IHHII", 16 + len(body), mtype, flags, 1, 0) + body)
    out = []
    while True:
        data, off = sk.recv(1 << 16), 0
        while off + 16 <= len(data):
            ln, rtype = struct.unpack_from("=IH", data, off)
            if rtype == _NLMSG_DONE:
                return out
            if rtype == _NLMSG_ERROR:
                err = struct.unpack_from("=i", data, off + 16)[0]
                if err:
                    raise OSError(-err, os.strerror(-err))
                return out
            attrs = _nla_parse(data[off + 16 + hdr_len:off + ln])
            out.append((data[off + 16:off + 16 + hdr_len], attrs) if headers else attrs)
            off += (ln + 3) & ~3
            if not dump:
                return out


def _genl(sk: socket.socket, family: int, cmd: int, attrs: bytes, dump: bool) -> list[dict]:
    return _nl_request(sk, family, struct.pack("=BBH", cmd, 1, 0) + attrs, 4, dump)


# Root qdisc counters over rtnetlink, in-process: a `tc` spawn costs about half
# a second under TCG (a few under KASAN), too slow for per-window snapshots.
_RTM_GETQDISC = 38
_TCA_KIND, _TCA_STATS2, _TCA_STATS_BASIC, _TCA_STATS_QUEUE = 1, 7, 1, 3
_TC_H_ROOT = 0xFFFFFFFF
_TCMSG = "=BBHiIII"         # struct tcmsg: family, pads, ifindex, handle, parent, info


def nl_root_qdisc(dev: str) -> dict:
    """Root qdisc counters of dev (the `tc -s qdisc` numbers): kind, packets
    (sent), drops, qlen, backlog (bytes), requeues, overlimits; {} without
    a root qdisc."""
    idx = socket.if_nametoindex(dev)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sk:
        replies = _nl_request(sk, _RTM_GETQDISC, struct.pack(_TCMSG, socket.AF_UNSPEC, 0, 0,
                                                             0, 0, 0, 0),
                              struct.calcsize(_TCMSG), dump=True, headers=True)
    for hdr, attrs in replies:
        _, _, _, ifi, _, parent, _ = struct.unpack(_TCMSG, hdr)
        if ifi != idx or parent != _TC_H_ROOT:
            continue
        q = {"kind": attrs.get(_TCA_KIND, b"").rstrip(b"\0").decode(), "packets": 0,
             "drops": 0, "qlen": 0, "backlog": 0, "requeues": 0, "overlimits": 0}
        st = _nla_parse(attrs.get(_TCA_STATS2, b""))
        if len(st.get(_TCA_STATS_BASIC, b"")) >= 12:
            q["packets"] = struct.unpack_from("=QI", st[_TCA_STATS_BASIC])[1]
        if len(st.get(_TCA_STATS_QUEUE, b"")) >= 20:
            (q["qlen"], q["backlog"], q["drops"], q["requeues"],
             q["overlimits"]) = struct.unpack_from("=5I", st[_TCA_STATS_QUEUE])
        return q
    return {}


def qdisc_drops(dev: str) -> int:
    """Drops the root qdisc of dev counted itself (`tc -s qdisc` dropped), 0
    without one; rtnetlink, no spawn."""
    return nl_root_qdisc(dev).get("drops", 0)


def qstats(dev: str) -> dict | None:
    """The device's TX queue statistics from the netdev netlink family:
    {"queues": {index: {"stop", "wake"}}, "total": {...}}, the
    total being the device's (detached queues included). None when the
    device reports no queue statistics (a tun without NODROP's counters).
    A kernel without that family (6.1) reports them through ethtool -S
    (ethtool_qstats())."""
    ifindex = socket.if_nametoindex(dev)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 16) as sk:  # NETLINK_GENERIC
        try:
            fam = _genl(sk, _GENL_ID_CTRL, _CTRL_CMD_GETFAMILY,
                        nla(_CTRL_ATTR_FAMILY_NAME, b"netdev\0"), dump=False)
        except FileNotFoundError:              # no netdev netlink family
            return ethtool_qstats(dev)
        family = struct.unpack("=H", fam[0][_CTRL_ATTR_FAMILY_ID][:2])[0]

        def dump(scope: int) -> list[dict]:
            try:
                return _genl(sk, family, _NETDEV_CMD_QSTATS_GET,
                             nla(_QSTATS_IFINDEX, struct.pack("=I", ifindex)) +
                             nla(_QSTATS_SCOPE, struct.pack("=I", scope)), dump=True)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    return []
                raise

        def tx(attrs: dict) -> dict:
            return {name: int.from_bytes(attrs.get(a, b""), "little")
                    for a, name in _QSTATS_TX.items()}

        dev_rows = [r for r in dump(0) if any(a in r for a in _QSTATS_TX)]
        if not dev_rows:
            return None
        queues = {int.from_bytes(r[_QSTATS_QUEUE_ID], "little"): tx(r)
                  for r in dump(1)
                  if int.from_bytes(r.get(_QSTATS_QUEUE_TYPE, b"\0"), "little") == 1}
        return {"queues": queues, "total": tx(dev_rows[0])}


# --- link state (rtnetlink RTM_GETLINK; uapi include/uapi/linux/if_link.h) ----------
_RTM_GETLINK = 18
_IFLA = {4: "mtu", 16: "operstate", 33: "carrier", 35: "carrier_changes"}
IF_OPER_DOWN, IF_OPER_LOWERLAYERDOWN, IF_OPER_UP = 2, 3, 6   # uapi if.h: rfc2863


def link_state(dev: str) -> dict:
    """{"mtu", "carrier", "carrier_changes", "operstate"} of dev in the caller's
    netns, without spawning a process (sysfs shows another netns)."""
    ifinfomsg = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, socket.if_nametoindex(dev), 0, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as sk:  # NETLINK_ROUTE
        attrs = _nl_request(sk, _RTM_GETLINK, ifinfomsg, len(ifinfomsg), dump=False)[0]
    return {name: int.from_bytes(attrs[a], "little") for a, name in _IFLA.items()
            if a in attrs}


_SIOCETHTOOL = 0x8946
_ETHTOOL_GDRVINFO = 0x3
_DRVINFO_SIZE = 196        # struct ethtool_drvinfo
_IFREQ_SIZE = 40           # struct ifreq on x86-64: name, then a union (ifr_data)


def rtnl_barrier(dev: str) -> None:
    """Return once whoever held RTNL when we asked has let it go: an ethtool
    ioctl (ETHTOOL_GDRVINFO) runs under RTNL. linkwatch sets the operstate
    and then (de)activates the qdiscs in one RTNL section, which RTM_GETLINK
    does not wait for everywhere (6.12 and 7.3 run a device's pending event
    first, 6.1 does not): after an operstate read as "up" followed by this
    barrier, the qdisc is active again. No spawn."""
    _ethtool(dev, struct.pack("=I", _ETHTOOL_GDRVINFO), _DRVINFO_SIZE)


def set_carrier(dev: str, on: bool) -> None:
    """Turn dev's carrier on or off and return once linkwatch has acted on
    it: it sets the operstate, then (de)activates the qdiscs (txq->qdisc is
    noop_qdisc while the carrier is off) in the same RTNL section. Waits
    for the operstate the change leads to ("up", or "down"), not for a
    change: a tun's carrier that never changed reports "unknown"."""
    sh(f"ip link set dev {dev} carrier {'on' if on else 'off'}")
    want = (IF_OPER_UP,) if on else (IF_OPER_DOWN, IF_OPER_LOWERLAYERDOWN)
    wait_for(f"{dev}: operstate after carrier {'on' if on else 'off'}",
             lambda: link_state(dev)["operstate"], lambda s: s in want, stall_s=10)
    rtnl_barrier(dev)


_ETHTOOL_GSTRINGS, _ETHTOOL_GSTATS, _ETHTOOL_GSSET_INFO = 0x1b, 0x1d, 0x37
_ETH_SS_STATS, _ETH_GSTRING_LEN = 1, 32


def _ethtool(dev: str, req: bytes, size: int) -> bytes:
    """One SIOCETHTOOL request (req: the command's struct head) with a
    reply buffer of `size` bytes; no spawn."""
    buf = ctypes.create_string_buffer(req, max(size, len(req)))
    ifr = struct.pack(f"={IFNAMSIZ}sQ", dev.encode(), ctypes.addressof(buf))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
        fcntl.ioctl(sk.fileno(), _SIOCETHTOOL, ifr.ljust(_IFREQ_SIZE, b"\0"))
    return buf.raw


def ethtool_stats(dev: str) -> dict[str, int]:
    """`ethtool -S dev` as {name: value} ({} when the driver has none)."""
    try:
        info = _ethtool(dev, struct.pack("=IIQ", _ETHTOOL_GSSET_INFO, 0, 1 << _ETH_SS_STATS),
                        20)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return {}
        raise
    mask, = struct.unpack_from("=Q", info, 8)
    n = struct.unpack_from("=I", info, 16)[0] if mask & (1 << _ETH_SS_STATS) else 0
    if not n:
        return {}
    names = _ethtool(dev, struct.pack("=III", _ETHTOOL_GSTRINGS, _ETH_SS_STATS, n),
                     12 + n * _ETH_GSTRING_LEN)
    vals = _ethtool(dev, struct.pack("=II", _ETHTOOL_GSTATS, n), 8 + 8 * n)
    got = struct.unpack_from("=I", vals, 4)[0]
    if got != n:                           # queues changed in between: ask again
        return ethtool_stats(dev)
    return {names[12 + i * 32:12 + (i + 1) * 32].split(b"\0")[0].decode():
            struct.unpack_from("=Q", vals, 8 + 8 * i)[0] for i in range(n)}


def ethtool_qstats(dev: str) -> dict | None:
    """qstats() where the kernel has no netdev netlink family (6.1): the
    series reports the same counters through ethtool -S, the device's
    totals as tx_stop / tx_wake and each queue's as tx_queue_<n>_stop /
    tx_queue_<n>_wake. None when the device has no such counters."""
    st = ethtool_stats(dev)
    if "tx_stop" not in st:
        return None
    queues: dict[int, dict] = {}
    for k, v in st.items():
        parts = k.split("_")
        if len(parts) == 4 and parts[:2] == ["tx", "queue"] and parts[3] in ("stop", "wake"):
            queues.setdefault(int(parts[2]), {})[parts[3]] = v
    return {"queues": queues, "total": {"stop": st["tx_stop"], "wake": st["tx_wake"]}}


def tun_flags_sysfs(dev: str) -> int:
    """/sys/class/net/<dev>/tun_flags as seen from the caller's netns: sysfs
    shows the netns it was mounted in, so mount a fresh one in a private
    mount namespace (root only)."""
    r = sh("unshare -m --propagation private sh -c "
           f"'mount -t sysfs sysfs /sys && cat /sys/class/net/{dev}/tun_flags'")
    return int(r.stdout.strip(), 16)


# --- byte queue limits (series v3: BQL under backpressure) ----------------------
def _sysfs_netns(cmd: str) -> str:
    """Run cmd with a sysfs of the caller's netns mounted on /sys (see
    tun_flags_sysfs). Raises FileNotFoundError when cmd fails."""
    r = sh("unshare -m --propagation private sh -c "
           f"'mount -t sysfs sysfs /sys && {cmd}'", check=False)
    if r.returncode:
        raise FileNotFoundError(r.stderr.strip())
    return r.stdout


def bql_dir(dev: str, queue: int = 0) -> str:
    return f"/sys/class/net/{dev}/queues/tx-{queue}/byte_queue_limits"


def bql(dev: str, queue: int = 0) -> dict | None:
    """The queue's byte_queue_limits (limit, inflight, limit_min, limit_max,
    and stall_thrs where the kernel has BQL's stall detection) as ints;
    None without the directory (stock tun, mainline, DKMS)."""
    try:
        out = _sysfs_netns(f"cd {bql_dir(dev, queue)} && "
                           "grep . limit inflight limit_min limit_max "
                           "$(ls stall_thrs 2>/dev/null)")
    except FileNotFoundError:
        return None
    return {k: int(v) for k, v in (line.split(":", 1) for line in out.split())}


def set_bql_attr(dev: str, attr: str, value: int, queue: int = 0) -> None:
    """Write one byte_queue_limits attribute of the caller's netns' dev."""
    _sysfs_netns(f"echo {value} > {bql_dir(dev, queue)}/{attr}")


def ring_level_only(dev: str) -> None:
    """For tests of the ring's own stop level (DRV_XOFF, txqueuelen packets):
    where tun keeps byte queue limits under backpressure, the queue would
    stop at the BQL limit first; switch BQL off with tun's "bql" ethtool
    private flag, so that only the ring stops it, as in series v2
    (test_bql.py tests BQL). Any time, also on a DKMS kernel (no sysfs).
    No-op on kernels without that flag (no BQL in tun)."""
    if has_priv_flag(dev, "bql"):
        set_priv_flag(dev, "bql", False)


# --- device setup ----------------------------------------------------------------
def setup_ip(dev: str, tap: bool, txqueuelen: int | None = None) -> None:
    """Address, route (connected /24) and, for TAP, a permanent neighbour, so
    UDP to PEER_IP leaves through dev with no ARP/ND traffic of its own."""
    if txqueuelen is not None:
        sh(f"ip link set dev {dev} txqueuelen {txqueuelen}")
    sh(f"ip addr add {LOCAL_IP}/{PREFIX} dev {dev}")
    sh(f"ip link set dev {dev} up")
    if tap:
        sh(f"ip neigh replace {PEER_IP} lladdr {PEER_MAC} dev {dev} nud permanent")


# --- C helpers ---------------------------------------------------------------------
@dataclass
class Tools:
    dir: str

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)


class Reader:
    """A running tools/tunreader process, driven over its stdin."""

    def __init__(self, proc: subprocess.Popen, label: str):
        self.proc = proc
        self.label = label
        self._buf = b""
        self.last: dict = {}
        self.ready = self._reply(60)

    def _readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"tunreader {self.label}: no answer in {timeout}s")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise AssertionError(f"tunreader {self.label} exited "
                                         f"(rc={self.proc.poll()}): {err}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _reply(self, timeout: float) -> dict:
        self.last = json.loads(self._readline(timeout))
        return self.last

    def cmd(self, text: str, timeout: float = 60) -> dict:
        self.proc.stdin.write((text + "\n").encode())
        self.proc.stdin.flush()
        return self._reply(timeout)

    def go(self) -> dict:
        return self.cmd("go")

    def pause(self) -> dict:
        return self.cmd("pause")

    def stat(self) -> dict:
        return self.cmd("stat")

    def wait(self, key: str, n: int, stall_s: float = 60.0) -> dict:
        """Block until counter key reaches n or nothing was read for stall_s
        seconds. Returns the counters; r["result"] is "ok" or "stall"."""
        # the hard timeout only guards against a wedged tunreader
        return self.cmd(f"wait {key} {n} {int(stall_s * 1000)}",
                        timeout=stall_s * 20 + 600)

    def empty(self) -> dict:
        """Read until the queue has nothing left (read() says EAGAIN): after
        the qdisc's backlog reached 0, nothing more can arrive."""
        r = self.cmd("empty")
        assert r.get("result") == "empty", f"tunreader {self.label}: empty: {r}"
        return r

    def quit(self) -> dict:
        if self.proc.poll() is not None:
            return self.last
        try:
            r = self.cmd("quit", timeout=30)
        finally:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return r


class VhostRx(Reader):
    """A running tools/vhostrx process (same protocol as tunreader, plus
    detach/attach of the vhost backend)."""

    def _checked(self, text: str) -> dict:
        r = self.cmd(text)
        assert r.get("event") != "error", f"vhostrx {self.label}: '{text}' -> {r}"
        return r

    def detach(self) -> dict:
        return self._checked("detach")

    def attach(self) -> dict:
        return self._checked("attach")

    def go(self) -> dict:
        return self._checked("go")


class Sender:
    """A tools/udpburst process."""

    def __init__(self, proc: subprocess.Popen, label: str):
        self.proc = proc
        self.label = label
        self.result: dict | None = None

    def start(self) -> None:
        """Release a sender started with wait_stdin=True."""
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 300) -> dict:
        """Wait for the sender to end by itself (its count reached)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"STALL: sender {self.label} still sending after "
                                 f"{timeout}s (blocked?) stderr={err!r}")
        if self.proc.returncode != 0:
            raise AssertionError(f"sender {self.label} rc={self.proc.returncode}: {err!r}")
        self.result = json.loads(out.decode().strip().splitlines()[-1])
        return self.result

    def stop(self, timeout: float = 60) -> dict:
        """SIGTERM a continuous sender and collect its counts."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.finish(timeout)


class Env:
    """Per-test state: processes and fds to clean up, tools, feature bits."""

    def __init__(self, tools: Tools, bp: bool):
        self.tools = tools
        self.bp = bp
        self.procs: list[subprocess.Popen] = []
        self.tuns: list[Tun] = []
        self.persistent: list[tuple[str, int]] = []
        # kernel log patterns this test expects and only records
        self.kmsg_allowed: list[str] = []

    def allow_kmsg(self, pattern: str) -> None:
        self.kmsg_allowed.append(pattern)

    # devices
    def tun(self, name: str, flags: int, vnet_hdr_sz: int | None = None) -> Tun:
        t = Tun(name, flags, vnet_hdr_sz)
        self.tuns.append(t)
        return t

    def bp_flag(self) -> int:
        """IFF_BACKPRESSURE when the kernel advertises it, else 0."""
        return IFF_BACKPRESSURE if self.bp else 0

    # processes
    def _spawn(self, argv: list[str], pass_fds=()) -> subprocess.Popen:
        log("+ " + " ".join(shlex.quote(a) for a in argv))
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, pass_fds=tuple(pass_fds))
        self.procs.append(p)
        return p

    def reader(self, tun: Tun | None = None, *, dev: str | None = None,
               flags: int = 0, tap: bool = False, vnet: int = 0,
               delay_us: int = 0, paused: bool = False, cpu: int | None = None,
               label: str = "reader") -> Reader:
        argv = [self.tools.path("tunreader")]
        pass_fds = []
        if tun is not None:
            argv += ["--fd", str(tun.fd)]
            pass_fds.append(tun.fd)
        else:
            argv += ["--dev", dev, "--flags", hex(flags)]
        if tap:
            argv.append("--tap")
        if vnet:
            argv += ["--vnet-hdr", str(vnet)]
        if delay_us:
            argv += ["--delay-us", str(delay_us)]
        if paused:
            argv.append("--paused")
        if cpu is not None:
            argv += ["--cpu", str(cpu)]
        return Reader(self._spawn(argv, pass_fds), label)

    def vhostrx(self, tun: Tun, *, paused: bool = False, detached: bool = False,
                rate: int = 0, bufs: int | None = None, cpu: int | None = None,
                label: str = "vhostrx") -> VhostRx:
        """tools/vhostrx as the consumer of tun's queue (vhost-net RX)."""
        prog = self.tools.path("vhostrx")
        if not os.access(prog, os.X_OK):
            raise AssertionError(f"missing helper {prog}: run `make -C tools OUT={self.tools.dir}`")
        argv = [prog, "--fd", str(tun.fd)]
        if paused:
            argv.append("--paused")
        if detached:
            argv.append("--detached")
        if rate:
            argv += ["--rate", str(rate)]
        if bufs:
            argv += ["--bufs", str(bufs)]
        if cpu is not None:
            argv += ["--cpu", str(cpu)]
        rx = VhostRx(self._spawn(argv, [tun.fd]), label)
        rx.tun = tun       # the test's fd of the same queue: ring_empty()
        log(f"{label} ready: {rx.ready}")
        return rx

    def sender(self, count: int, *, size: int = 1000, ident: int = 0,
               cpu: int | None = None, sndbuf: int | None = None,
               sport: int | None = None, flows: int = 1, pps: int = 0,
               wait_stdin: bool = False, dst: str = PEER_IP,
               label: str | None = None) -> Sender:
        argv = [self.tools.path("udpburst"), "--dst", dst, "--port", str(UDP_PORT),
                "--count", str(count), "--size", str(size), "--id", str(ident)]
        if cpu is not None:
            argv += ["--cpu", str(cpu)]
        if sndbuf:
            argv += ["--sndbuf", str(sndbuf)]
        if sport:
            argv += ["--sport", str(sport), "--src", LOCAL_IP]
        if flows > 1:
            argv += ["--flows", str(flows)]
        if pps:
            argv += ["--pps", str(pps)]
        if wait_stdin:
            argv.append("--wait-stdin")
        return Sender(self._spawn(argv), label or f"udpburst#{ident}")

    def burst(self, count: int, **kw) -> dict:
        """Send count datagrams and wait for the sender to finish."""
        s = self.sender(count, **kw)
        r = s.finish()
        log(f"sender {s.label}: {r}")
        return r

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for s in (p.stdin, p.stdout, p.stderr):
                try:
                    if s:
                        s.close()
                except OSError:
                    pass
        for name, flags in self.persistent:
            for f in (flags, flags ^ IFF_BACKPRESSURE):
                try:
                    t = Tun(name, f)
                except OSError:
                    continue
                t.set_persist(False)
                t.close()
                break
        for t in self.tuns:
            t.close()


def cpus() -> list[int]:
    """CPUs this process may run on (taskset-aware)."""
    return sorted(os.sched_getaffinity(0))


def udp_socket_from(sport: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((LOCAL_IP, sport))
    return s


def probe_payload(ident: int, seq: int) -> bytes:
    return b"NDRP" + struct.pack("!III", ident, seq, 0) + b"\0" * 48


def read_all_nonblocking(fd: int) -> list[bytes]:
    pkts = []
    while True:
        try:
            pkts.append(os.read(fd, 65536))
        except BlockingIOError:
            return pkts
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EBADFD):
                return pkts
            raise
