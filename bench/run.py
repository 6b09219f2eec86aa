"""NODROP benchmarks, run inside one guest (one kernel flavor).

Environment (all optional except NODROP_TOOLS / NODROP_RESULTS in the lab):
  NODROP_TOOLS    dir with udpburst, tunreader, tunnel, vidstream [, vhostrx]
  NODROP_RESULTS  where the raw JSON goes (one file per scenario)
  NODROP_FLAVOR   label only, copied into the JSON
  QUICK=1         reduced set (a few minutes per flavor)
  REPS            repetitions per point, every scenario (default 5, QUICK 3)
  DURATION        seconds per measured point, every scenario (default: per
                  scenario, see docs/bench.md; iperf3 rounds to whole seconds)
  SCENARIOS       comma list, e.g. "1,4,5,6" (default: all)
  S4_SPIN_US      busy-wait per packet of tunnel A's reader in scenario 4 (60)
  S6_RATE_PPS     packet rate of tunnel A's paced reader in scenario 6 (1000)
  S6_WARMUP       seconds of bulk TCP before the pings of scenario 6 (1.5,
                  QUICK 1.0)

Writes <scenario>.json per scenario (elapsed_s in each) and run.json (total
time of the run).

Feature detection only: TUNGETFEATURES & IFF_BACKPRESSURE (0x0080) decides
whether the "bp" configuration (flag + fq_codel) is measured next to
"stock". The flavor name is never looked at.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "guest"))
import tunlib as tl  # noqa: E402

ROOT_NS_FD = os.open("/proc/self/ns/net", os.O_RDONLY)
IFF_TUN, IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x0002, 0x1000, 0x4000
BP = tl.IFF_BACKPRESSURE
PG = "/proc/net/pktgen"
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[bench {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def sh(cmd: str, check: bool = True) -> str:
    return tl.sh(cmd, check=check).stdout


# --- network namespaces held by a sleeping process ----------------------------
class NS:
    def __init__(self, name: str):
        self.name = name
        self.proc = subprocess.Popen(["unshare", "--net", "sleep", "100000"])
        own = os.stat("/proc/self/ns/net").st_ino
        path = f"/proc/{self.proc.pid}/ns/net"
        for _ in range(500):
            try:
                if os.stat(path).st_ino != own:
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        else:
            raise RuntimeError("unshare --net did not create a namespace")
        self.fd = os.open(path, os.O_RDONLY)
        with self:
            sh("ip link set lo up")
            sh("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
               "net.ipv6.conf.default.disable_ipv6=1", check=False)

    def __enter__(self):
        tl.setns(self.fd)
        return self

    def __exit__(self, *a):
        tl.setns(ROOT_NS_FD)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self):
        os.close(self.fd)
        self.proc.kill()
        self.proc.wait()


class Procs:
    """Background processes of one setup, killed on close."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("text", True)
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, **kw)
        self.procs.append(p)
        return p

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.communicate(timeout=10)
            except Exception:
                pass
        self.procs = []


def term(p: subprocess.Popen, timeout: float = 30) -> str:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    return out or ""


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}


def qdisc_counts(dev: str) -> dict:
    """Root qdisc counters: rtnetlink in-process (cheap), `tc` as fallback."""
    try:
        q = nl_root_qdisc(dev)
        if q:
            return q
    except OSError:
        pass
    try:
        return tl.qdisc_totals(dev)
    except Exception:
        return {"kind": "none", "packets": 0, "drops": 0, "qlen": 0, "backlog": 0}


# --- cheap in-process probes ------------------------------------------------------
# tc/ss are a fork+exec each, about half a second under TCG with the benchmark
# running: too slow and too disturbing to sample a standing queue with. These
# read the same counters from rtnetlink and /proc in the calling netns.
RTM_NEWQDISC, RTM_GETQDISC = 36, 38
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_ERROR, NLMSG_DONE = 1, 0x300, 2, 3
TCA_KIND, TCA_STATS2, TCA_STATS_BASIC, TCA_STATS_QUEUE = 1, 7, 1, 3
TC_H_ROOT = 0xFFFFFFFF


def _rtattrs(buf: bytes, off: int, end: int):
    while off + 4 <= end:
        ln, typ = struct.unpack_from("=HH", buf, off)
        if ln < 4:
            break
        yield typ & 0x3FFF, buf[off + 4:off + ln]
        off += (ln + 3) & ~3


def nl_root_qdisc(dev: str) -> dict:
    """Root qdisc counters of dev (the `tc -s qdisc` numbers): kind, packets
    (sent), drops, qlen, backlog (bytes)."""
    idx = socket.if_nametoindex(dev)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.send(struct.pack("=IHHII", 36, RTM_GETQDISC, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
               + struct.pack("=BBHiIII", socket.AF_UNSPEC, 0, 0, 0, 0, 0, 0))
        found: dict = {}
        while True:
            data = s.recv(1 << 16)
            off = 0
            while off + 16 <= len(data):
                ln, typ = struct.unpack_from("=IH", data, off)
                if typ == NLMSG_DONE:
                    return found
                if typ == NLMSG_ERROR:
                    raise OSError(f"RTM_GETQDISC: {struct.unpack_from('=i', data, off + 16)[0]}")
                if typ == RTM_NEWQDISC:
                    _, _, _, ifi, _, parent, _ = struct.unpack_from("=BBHiIII", data, off + 16)
                    if ifi == idx and parent == TC_H_ROOT:
                        q = {"kind": "", "packets": 0, "drops": 0, "qlen": 0, "backlog": 0}
                        for t, v in _rtattrs(data, off + 36, off + ln):
                            if t == TCA_KIND:
                                q["kind"] = v.rstrip(b"\0").decode()
                            elif t == TCA_STATS2:
                                for t2, v2 in _rtattrs(v, 0, len(v)):
                                    if t2 == TCA_STATS_BASIC and len(v2) >= 12:
                                        q["packets"] = struct.unpack_from("=QI", v2)[1]
                                    elif t2 == TCA_STATS_QUEUE and len(v2) >= 12:
                                        q["qlen"], q["backlog"], q["drops"] = \
                                            struct.unpack_from("=III", v2)
                        found = q
                if ln < 16:
                    break
                off += (ln + 3) & ~3


def udp_queues(port: int = 4000) -> tuple[int, int]:
    """(send, receive) queue in bytes of the UDP socket bound to port
    (/proc/net/udp tx_queue:rx_queue = sk_wmem_alloc, sk_rmem_alloc)."""
    with open("/proc/net/udp") as f:
        for line in f.readlines()[1:]:
            p = line.split()
            if int(p[1].split(":")[1], 16) == port:
                tx, rx = p[4].split(":")
                return int(tx, 16), int(rx, 16)
    return 0, 0


# --- configurations ------------------------------------------------------------
def configs(bp_ok: bool, qlen: int | None = None) -> list[dict]:
    """stock: no flag, the device's default qdisc; bp: IFF_BACKPRESSURE +
    fq_codel (default parameters: real AQM), only where the kernel has it."""
    c = [{"name": "stock", "flag": 0, "qdisc": None, "qlen": qlen}]
    if bp_ok:
        c.append({"name": "bp", "flag": BP, "qdisc": "fq_codel", "qlen": qlen})
    return c


def apply_dev(dev: str, cfg: dict) -> str:
    if cfg.get("qlen"):
        sh(f"ip link set dev {dev} txqueuelen {cfg['qlen']}")
    if cfg.get("qdisc"):
        sh(f"tc qdisc replace dev {dev} root {cfg['qdisc']}")
    return qdisc_counts(dev)["kind"]


# --- the VPN path: tunnel A (nsA) <-UDP over veth-> tunnel B (nsB) -------------
TUN_A, TUN_B = "172.30.0.1", "172.30.0.2"
VETH_A, VETH_B = "10.99.0.1", "10.99.0.2"


class VPN:
    def __init__(self, tools: str, cfg: dict, delay_us: int = 0, spin_us: int = 0,
                 rate_pps: int = 0):
        self.cfg = cfg
        self.procs = Procs()
        self.a, self.b = NS("A"), NS("B")
        with self.a:
            sh(f"ip link add va type veth peer name vb netns {self.b.pid}")
            sh(f"ip addr add {VETH_A}/24 dev va && ip link set va up")
        with self.b:
            sh(f"ip addr add {VETH_B}/24 dev vb && ip link set vb up")
        self.iff = {}
        for ns, dev, me, peer, lip, pip, slow in (
                (self.a, "tA", VETH_A, VETH_B, TUN_A, TUN_B, (delay_us, spin_us, rate_pps)),
                (self.b, "tB", VETH_B, VETH_A, TUN_B, TUN_A, (0, 0, 0))):
            with ns:
                argv = [os.path.join(tools, "tunnel"), "--dev", dev, "--flags",
                        hex(IFF_TUN | IFF_NO_PI | cfg["flag"]),
                        "--local", f"{me}:4000", "--peer", f"{peer}:4000"]
                if slow[0]:
                    argv += ["--delay-us", str(slow[0])]
                if slow[1]:
                    argv += ["--spin-us", str(slow[1])]
                if slow[2]:
                    argv += ["--rate-pps", str(slow[2])]
                p = self.procs.spawn(argv)
                ready = json.loads(p.stdout.readline() or "{}")
                if ready.get("event") != "ready":
                    raise RuntimeError(f"tunnel {dev} failed: {p.stderr.read()}")
                self.iff[dev] = ready["iff"]
                sh(f"ip link set dev {dev} mtu 1400")
                sh(f"ip addr add {lip} peer {pip} dev {dev}")
                sh(f"ip link set dev {dev} up")
                self.qdisc = apply_dev(dev, cfg)
        if cfg["flag"] and not self.iff["tA"] & BP:
            raise RuntimeError("kernel reports backpressure but TUNGETIFF lacks it")

    def reconfigure(self, cfg: dict):
        """Another configuration with the same TUNSETIFF flags: ring size and
        root qdisc of both tuns (no qdisc given: back to the default one)."""
        assert cfg["flag"] == self.cfg["flag"]
        self.cfg = cfg
        for ns, dev in ((self.a, "tA"), (self.b, "tB")):
            with ns:
                if not cfg.get("qdisc"):
                    sh(f"tc qdisc del dev {dev} root", check=False)
                self.qdisc = apply_dev(dev, cfg)

    def iperf_server(self, port: int = 5201) -> subprocess.Popen:
        """One iperf3 server per VPN (nsB), reused by every test."""
        srv = getattr(self, "_srv", None)
        if srv is not None and srv.poll() is None:
            return srv
        with self.b:
            srv = self._srv = self.procs.spawn(["iperf3", "-s", "-B", TUN_B, "-p", str(port)])
            for _ in range(400):
                if f":{port}" in sh("ss -ltnH", check=False):
                    break
                time.sleep(0.05)
        return srv

    def set_qlen(self, qlen: int):
        for ns, dev in ((self.a, "tA"), (self.b, "tB")):
            with ns:
                sh(f"ip link set dev {dev} txqueuelen {qlen}")

    def set_netem(self, delay_ms: int = 0, rate: str | None = None):
        with self.a:
            if not delay_ms and not rate:
                sh("tc qdisc del dev va root", check=False)
                return
            spec = f"netem delay {delay_ms}ms limit 100000"
            if rate:
                spec += f" rate {rate}"
            sh(f"tc qdisc replace dev va root {spec}")

    def counters(self) -> dict:
        with self.a:
            s = tl.dev_stats("tA")
            q = qdisc_counts("tA")
        return {"tx_dropped": s["tx_dropped"], "tx_packets": s["tx_packets"],
                "qdisc_drops": q["drops"], "qdisc_sent": q["packets"],
                "qdisc_qlen": q["qlen"]}

    def probe(self) -> dict:
        """Where packets wait, per side, without forking: root qdisc backlog,
        packets in the tun ring (qdisc sent - read by the tunnel - ring
        drops: a difference against an idle probe gives the occupancy),
        and the tunnel's UDP socket queues in bytes."""
        out = {"t": time.monotonic()}
        for ns, dev, side in ((self.a, "tA", "A"), (self.b, "tB", "B")):
            with ns:
                q = nl_root_qdisc(dev)
                st = tl.dev_stats(dev)
                utx, urx = udp_queues()
            out[side] = {"q_pkts": q.get("qlen", 0), "read": st["tx_packets"],
                         "ring_x": q.get("packets", 0) - st["tx_packets"] - st["tx_dropped"],
                         "udp_tx": utx, "udp_rx": urx}
        return out

    def drain_all(self, timeout: float = 20):
        """Until tA's qdisc is empty and tunnel A has read nothing for
        0.2 s (then its ring is empty too: a reader with packets waiting
        reads far more often than that, even when rate-limited)."""
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            p = self.probe()["A"]
            if last is not None and not p["q_pkts"] and p["read"] == last:
                return
            last = p["read"]
            time.sleep(0.2)

    def drain(self, timeout: float = 20):
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.counters()["qdisc_qlen"]:
            time.sleep(0.1)

    def close(self):
        self.procs.close()
        self.a.close()
        self.b.close()


def delta(c0: dict, c1: dict) -> dict:
    return {k: c1[k] - c0[k] for k in ("tx_dropped", "qdisc_drops")}


def isec(d: float) -> int:
    """iperf3 -t takes whole seconds (3.12 parses it with atoi)."""
    return max(1, int(round(d)))


def iperf_start(vpn: VPN, duration: float, streams: int = 1, port: int = 5201):
    """Start server (nsB) and client (nsA); no threads: setns and /proc/net
    are per thread / per thread-group leader."""
    srv = vpn.iperf_server(port)
    c0 = vpn.counters()
    with vpn.a:
        cli = vpn.procs.spawn(["iperf3", "-c", TUN_B, "-p", str(port), "-t",
                               str(isec(duration)), "-P", str(streams), "-J"])
    return srv, cli, c0, duration


def iperf_finish(vpn: VPN, h) -> dict:
    srv, cli, c0, duration = h
    try:
        stdout, stderr = cli.communicate(timeout=duration * 10 + 120)
    except subprocess.TimeoutExpired:
        cli.kill()
        stdout, stderr = cli.communicate()
    c1 = vpn.counters()
    try:
        end = json.loads(stdout)["end"]
        out = {"mbps": end["sum_received"]["bits_per_second"] / 1e6,
               "mbps_sent": end["sum_sent"]["bits_per_second"] / 1e6,
               "retransmits": end["sum_sent"].get("retransmits", 0)}
    except Exception as e:  # noqa: BLE001
        out = {"error": f"iperf3 rc={cli.returncode} {e}: {stdout[-300:]} {stderr[-300:]}"}
    out.update(delta(c0, c1))
    return out


def iperf(vpn: VPN, duration: float, streams: int = 1) -> dict:
    return iperf_finish(vpn, iperf_start(vpn, duration, streams))


# --- scenario 1/2: pktgen -> TAP ---------------------------------------------------
def pg_write(path: str, cmd: str) -> None:
    with open(path, "w") as f:
        f.write(cmd + "\n")


def pg_counts(path: str) -> tuple[int, int]:
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("pkts-sofar:"):
                parts = line.replace(":", " ").split()
                return int(parts[1]), int(parts[3])
    return 0, 0


def pktgen_point(tools: str, cfg: dict, threads: int, mode: str, vnet: bool,
                 reps: int, duration: float, warmup: float,
                 consumer: str = "tunreader") -> dict:
    ns = NS("pg")
    procs = Procs()
    point = {"config": cfg["name"], "threads": threads, "xmit_mode": mode,
             "reader": "vnet_hdr" if vnet else "plain", "reps": []}
    try:
        with ns:
            flags = IFF_TAP | IFF_NO_PI | cfg["flag"] | (IFF_VNET_HDR if vnet else 0)
            if consumer == "vhostrx":
                argv = [os.path.join(tools, "vhostrx"), "--dev", "pg0", "--flags",
                        hex(flags)]
            else:
                argv = [os.path.join(tools, "tunreader"), "--dev", "pg0", "--flags",
                        hex(flags), "--tap"]
                if vnet:
                    argv += ["--vnet-hdr", "12"]
            p = procs.spawn(argv, text=False)
            reader = tl.Reader(p, "pg0")
            tl.setup_ip("pg0", tap=True, txqueuelen=cfg.get("qlen") or 500)
            point["qdisc"] = apply_dev("pg0", cfg)
            ths = sorted(n for n in os.listdir(PG) if n.startswith("kpktgend_"))[:threads]
            if len(ths) < threads:
                point["error"] = f"only {len(ths)} pktgen threads"
                return point
            devs = []
            for i, th in enumerate(ths):
                pg_write(f"{PG}/{th}", "rem_device_all")
                name = "pg0" if threads == 1 else f"pg0@{i}"
                pg_write(f"{PG}/{th}", f"add_device {name}")
                dp = f"{PG}/{name}"
                for c in ("count 0", "pkt_size 64", "clone_skb 0", "burst 1",
                          "delay 0", f"xmit_mode {mode}", f"dst {tl.PEER_IP}",
                          f"src_min {tl.LOCAL_IP}", f"src_max {tl.LOCAL_IP}",
                          f"dst_mac {tl.PEER_MAC}", "udp_dst_min 9", "udp_dst_max 9"):
                    pg_write(dp, c)
                devs.append(dp)
            for _ in range(reps):
                start = subprocess.Popen(["sh", "-c", f"echo start > {PG}/pgctrl"])
                time.sleep(warmup)

                def snap():
                    r = reader.stat()
                    s = tl.dev_stats("pg0")
                    pg = [pg_counts(d) for d in devs]
                    return {"t": time.monotonic(), "recv": r["pkts"],
                            "tx_dropped": s["tx_dropped"],
                            "qdisc_drops": qdisc_counts("pg0")["drops"],
                            "pg_sent": sum(x[0] for x in pg),
                            "pg_errors": sum(x[1] for x in pg), "bad": r["bad"]}
                s0 = snap()
                time.sleep(duration)
                s1 = snap()
                pg_write(f"{PG}/pgctrl", "stop")
                start.wait(timeout=120)
                dt = s1["t"] - s0["t"]
                rep = {k + "_per_s": (s1[k] - s0[k]) / dt
                       for k in ("recv", "tx_dropped", "qdisc_drops", "pg_sent", "pg_errors")}
                rep["seconds"] = dt
                rep["bad"] = s1["bad"]
                point["reps"].append(rep)
                # let the ring and qdisc drain before the next rep
                t_end = time.monotonic() + 30
                while time.monotonic() < t_end and qdisc_counts("pg0")["qlen"]:
                    time.sleep(0.2)
            reader.quit()
    finally:
        procs.close()
        ns.close()
    return point


def s1_pktgen(ctx) -> dict:
    if not os.path.isdir(PG):
        try:
            subprocess.run(["modprobe", "pktgen"], capture_output=True)
        except FileNotFoundError:
            pass
    res = {"scenario": "s1_pktgen_tap", "title": "pktgen -> TAP, user-space reader",
           "points": []}
    if not os.path.isdir(PG):
        res["skipped"] = "no /proc/net/pktgen in this kernel"
        return res
    d = ctx.dur(1.5, 1.0)
    # (threads, xmit_mode, vnet_hdr reader)
    cases = [(1, "queue_xmit", False), (2, "start_xmit", False)]
    if not ctx.quick:
        cases = [(1, "queue_xmit", False), (1, "queue_xmit", True),
                 (2, "queue_xmit", False), (2, "start_xmit", False),
                 (2, "queue_xmit", True), (2, "start_xmit", True)]
    res["params"] = {"duration_s": d, "pkt_size": 64, "txqueuelen": 500,
                     "cases": cases}
    for cfg in configs(ctx.bp):
        for threads, mode, vnet in cases:
            if True:
                say(f"s1 {cfg['name']} threads={threads} {mode} vnet={vnet}")
                pt = pktgen_point(ctx.tools, cfg, threads, mode, vnet, ctx.reps, d, 0.3)
                med = summ(pt["reps"], "recv_per_s")
                say(f"   recv {med} pps, ring drops "
                    f"{summ(pt['reps'], 'tx_dropped_per_s')}/s, qdisc drops "
                    f"{summ(pt['reps'], 'qdisc_drops_per_s')}/s")
                res["points"].append(pt)
    return res


def s2_vhost(ctx) -> dict:
    res = {"scenario": "s2_pktgen_vhost", "title": "pktgen -> TAP + vhost-net",
           "points": []}
    vr = os.path.join(ctx.tools, "vhostrx")
    if not os.access(vr, os.X_OK):
        res["skipped"] = "pending vhostrx (tools/vhostrx not built yet)"
        return res
    if not os.path.exists("/dev/vhost-net"):
        subprocess.run(["modprobe", "vhost_net"], capture_output=True)
    if not os.path.exists("/dev/vhost-net"):
        res["skipped"] = "no /dev/vhost-net in this kernel"
        return res
    if not os.path.isdir(PG):
        subprocess.run(["modprobe", "pktgen"], capture_output=True)
    if not os.path.isdir(PG):
        res["skipped"] = "no /proc/net/pktgen in this kernel"
        return res
    d = ctx.dur(1.5, 1.0)
    cases = [(1, "queue_xmit"), (2, "start_xmit")]
    if not ctx.quick:
        cases = [(1, "queue_xmit"), (2, "queue_xmit"), (2, "start_xmit")]
    res["params"] = {"duration_s": d, "pkt_size": 64, "txqueuelen": 500,
                     "consumer": "tools/vhostrx (vhost-net RX, 256-entry virtqueue)",
                     "cases": cases}
    for cfg in configs(ctx.bp):
        for threads, mode in cases:
            say(f"s2 {cfg['name']} threads={threads} {mode} vhost-net")
            pt = pktgen_point(ctx.tools, cfg, threads, mode, False, ctx.reps, d, 0.3,
                              consumer="vhostrx")
            say(f"   recv {summ(pt['reps'], 'recv_per_s')} pps, ring drops "
                f"{summ(pt['reps'], 'tx_dropped_per_s')}/s, qdisc drops "
                f"{summ(pt['reps'], 'qdisc_drops_per_s')}/s")
            res["points"].append(pt)
    return res


# --- scenario 3: TCP through the tunnel, ring x delay --------------------------
def s3_tcp_grid(ctx) -> dict:
    # 12 points x reps x configs: the longest scenario; 2 s points (1 s in
    # QUICK) keep `make bench` of three flavors within its time budget
    d = isec(ctx.dur(2.0, 1.0))
    qlens = [10, 1000] if ctx.quick else [1, 10, 100, 1000]
    delays = [60] if ctx.quick else [0, 60, 120]
    res = {"scenario": "s3_tcp_grid", "title": "TCP through the tunnel: txqueuelen x netem delay",
           "params": {"duration_s": d, "qlens": qlens, "delays_ms": delays, "reps": ctx.reps},
           "points": []}
    for cfg in configs(ctx.bp):
        vpn = VPN(ctx.tools, cfg)
        try:
            for delay in delays:
                vpn.set_netem(delay)
                for q in qlens:
                    vpn.set_qlen(q)
                    pt = {"config": cfg["name"], "qlen": q, "delay_ms": delay,
                          "qdisc": vpn.qdisc, "reps": []}
                    for _ in range(ctx.reps):
                        pt["reps"].append(iperf(vpn, d))
                        vpn.drain()
                    say(f"s3 {cfg['name']} q={q} delay={delay}ms: "
                        f"{summ(pt['reps'], 'mbps')} Mbit/s retr {summ(pt['reps'], 'retransmits')}")
                    res["points"].append(pt)
        finally:
            vpn.close()
    return res


# --- scenario 4: bursty video over the VPN ------------------------------------------
def s4_video(ctx) -> dict:
    d = ctx.dur(3.0, 2.0)
    fpss = [60] if ctx.quick else [30, 60]
    spin = int(os.environ.get("S4_SPIN_US", 60))
    res = {"scenario": "s4_video", "title": "bursty video over the VPN (txqueuelen 25, slow tunnel reader)",
           "params": {"duration_s": d, "qlen": 25, "frame_pkts": 30, "size": 1200,
                      "fps": fpss, "reader_spin_us": spin},
           "points": []}
    for cfg in configs(ctx.bp, qlen=25):
        vpn = VPN(ctx.tools, cfg, spin_us=spin)
        try:
            vpn.set_qlen(25)
            for fps in fpss:
                pt = {"config": cfg["name"], "fps": fps, "qdisc": vpn.qdisc, "reps": []}
                for _ in range(ctx.reps):
                    with vpn.b:
                        rcv = vpn.procs.spawn([os.path.join(ctx.tools, "vidstream"), "--recv",
                                               "--bind", TUN_B, "--port", "6000"])
                        rcv.stdout.readline()
                    c0 = vpn.counters()
                    with vpn.a:
                        snd = subprocess.run(
                            [os.path.join(ctx.tools, "vidstream"), "--send", "--dst", TUN_B,
                             "--port", "6000", "--fps", str(fps), "--frame-pkts", "30",
                             "--size", "1200", "--duration", str(d)],
                            capture_output=True, text=True, timeout=d * 20 + 60)
                    vpn.drain()
                    time.sleep(0.5)
                    c1 = vpn.counters()
                    r = last_json(term(rcv))
                    s = last_json(snd.stdout)
                    frames, pkts = s.get("frames", 0), s.get("pkts", 0)
                    rep = {"frames_sent": frames, "pkts_sent": pkts,
                           "pkts_recv": r.get("pkts", 0),
                           "frames_complete": r.get("complete", 0),
                           "loss_pct": 100.0 * (1 - r.get("pkts", 0) / pkts) if pkts else None,
                           "complete_pct": 100.0 * r.get("complete", 0) / frames if frames else None,
                           # latency of complete frames only; none complete -> no value
                           "lat_ms_p50": r.get("lat_ms_p50") if r.get("complete") else None,
                           "lat_ms_p99": r.get("lat_ms_p99") if r.get("complete") else None,
                           "late_frames": s.get("late", 0), "hist": r.get("hist")}
                    rep.update(delta(c0, c1))
                    pt["reps"].append(rep)
                say(f"s4 {cfg['name']} {fps}fps: loss {summ(pt['reps'], 'loss_pct')} % "
                    f"complete {summ(pt['reps'], 'complete_pct')} % ring drops "
                    f"{summ(pt['reps'], 'tx_dropped')}")
                res["points"].append(pt)
        finally:
            vpn.close()
    return res


# --- scenario 5: parallel TCP streams ----------------------------------------------
def s5_parallel(ctx) -> dict:
    """stock and bp side by side on the same kernel, interleaved: both VPNs
    exist at once and every repetition measures one then the other, in
    alternating order (stock, bp / bp, stock / ...), so that drift of the
    host (other VMs, CPU frequency) hits both alike. The report pairs
    repetition i of bp with repetition i of stock (bp/stock ratio)."""
    d = isec(ctx.dur(2.0, 1.0))
    streams = [1, 8] if ctx.quick else [1, 2, 4, 8]
    cfgs = configs(ctx.bp, qlen=500)
    res = {"scenario": "s5_parallel", "title": "parallel TCP streams through one tun queue",
           "params": {"duration_s": d, "streams": streams, "qlen": 500,
                      "interleaved": len(cfgs) > 1},
           "points": []}
    vpns: dict[str, VPN] = {}
    try:
        for cfg in cfgs:
            vpns[cfg["name"]] = VPN(ctx.tools, cfg)
        for n in streams:
            pts = {c["name"]: {"config": c["name"], "streams": n,
                               "qdisc": vpns[c["name"]].qdisc, "reps": []} for c in cfgs}
            for i in range(ctx.reps):
                order = cfgs if i % 2 == 0 else cfgs[::-1]
                for k, cfg in enumerate(order):
                    vpn = vpns[cfg["name"]]
                    r = iperf(vpn, d, streams=n)
                    r["pair"], r["slot"] = i, k
                    vpn.drain()
                    pts[cfg["name"]]["reps"].append(r)
            for c in cfgs:
                r = pts[c["name"]]["reps"]
                say(f"s5 {c['name']} -P {n}: {summ(r, 'mbps')} Mbit/s "
                    f"ring drops {summ(r, 'tx_dropped')}")
            if len(cfgs) > 1:
                ratios = [{"ratio": b["mbps"] / a["mbps"]}
                          for a, b in zip(pts["stock"]["reps"], pts["bp"]["reps"])
                          if a.get("mbps") and b.get("mbps") is not None]
                say(f"s5 -P {n}: bp/stock per pair {summ(ratios, 'ratio')}")
            res["points"] += list(pts.values())
    finally:
        for v in vpns.values():
            v.close()
    return res


# --- scenario 6: latency under load ---------------------------------------------------
RTT_RE = re.compile(r"time=([0-9.]+) ms")


def pct(vals: list[float], p: float) -> float | None:
    if not vals:
        return None
    v = sorted(vals)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def queue_summary(base: dict, samples: list[dict]) -> dict:
    """Median over the samples of each place a standing queue can form."""
    def med(f):
        v = [f(x) for x in samples]
        return statistics.median(v) if v else None
    return {
        "tA_qdisc_pkts": med(lambda x: x["A"]["q_pkts"]),
        "tA_ring_pkts": med(lambda x: x["A"]["ring_x"] - base["A"]["ring_x"]),
        "A_udp_tx_kB": med(lambda x: x["A"]["udp_tx"] / 1024),
        "A_udp_rx_kB": med(lambda x: x["A"]["udp_rx"] / 1024),
        "B_udp_rx_kB": med(lambda x: x["B"]["udp_rx"] / 1024),
        "tB_ring_pkts": med(lambda x: x["B"]["ring_x"] - base["B"]["ring_x"]),
        "tB_qdisc_pkts": med(lambda x: x["B"]["q_pkts"]),
        "samples": len(samples)}


def s6_latency(ctx) -> dict:
    d = isec(ctx.dur(3.0, 2.0))
    cfgs = [{"name": "stock", "flag": 0, "qdisc": None, "qlen": 500}]
    if not ctx.quick:
        # a small ring + fq_codel without the flag: low latency, ring drops
        cfgs.append({"name": "stock-q25-fq_codel", "flag": 0, "qdisc": "fq_codel", "qlen": 25})
    if ctx.bp:
        cfgs.append({"name": "bp", "flag": BP, "qdisc": "fq_codel", "qlen": 25})
    # Tunnel A reads its tun at a fixed packet rate (a slow uplink behind the
    # VPN), sleeping between packets, so the bottleneck and its standing queue
    # are at tA (ring for stock, qdisc for bp) and nowhere else: the rate is
    # well below what the rest of the path carries under TCG, and tunnel A
    # keeps serving the return path (ping replies, ACKs) while throttled.
    # (A CPU-bound "slow crypto" reader does not do that: see docs/bench.md.)
    rate = int(os.environ.get("S6_RATE_PPS", 1000))
    # the earlier method, for comparison only: S6_RATE_PPS=0 S6_SPIN_US=100
    spin = int(os.environ.get("S6_SPIN_US", 0) or 0)
    warm = float(os.environ.get("S6_WARMUP", 1.0 if ctx.quick else 1.5))
    interval = 0.05
    res = {"scenario": "s6_latency", "title": "ping RTT through the VPN under bulk TCP",
           "params": {"duration_s": d, "warmup_s": warm, "ping_interval_s": interval,
                      "tunnel_a_rate_pps": rate, "tunnel_a_spin_us": spin},
           "points": []}
    vpn = None
    try:
        for cfg in cfgs:
            # stock and stock-q25-fq_codel share one VPN (same flags)
            if vpn is not None and vpn.cfg["flag"] == cfg["flag"]:
                vpn.reconfigure(cfg)
            else:
                if vpn is not None:
                    vpn.close()
                vpn = VPN(ctx.tools, cfg, rate_pps=rate, spin_us=spin)
            pt = {"config": cfg["name"], "qlen": cfg["qlen"], "qdisc": vpn.qdisc, "reps": []}
            vpn.drain_all()
            for _ in range(ctx.reps):
                base = vpn.probe()
                h = iperf_start(vpn, warm + d + 1)
                time.sleep(warm)
                with vpn.a:
                    pr = subprocess.Popen(["ping", "-n", "-i", str(interval), "-w", str(int(d)),
                                           TUN_B], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
                samples = []
                while pr.poll() is None:
                    time.sleep(0.25)
                    samples.append(vpn.probe())
                pout = pr.communicate()[0]
                out = iperf_finish(vpn, h)
                rtts = [float(x) for x in RTT_RE.findall(pout)]
                rep = {"p50_ms": pct(rtts, 50), "p99_ms": pct(rtts, 99),
                       "max_ms": max(rtts) if rtts else None,
                       "pings_answered": len(rtts), "pings_approx_sent": int(d / interval),
                       "bulk_mbps": out.get("mbps"),
                       "tx_dropped": out.get("tx_dropped"),
                       "qdisc_drops": out.get("qdisc_drops")}
                rep.update(queue_summary(base, samples[:-1] or samples))
                q = (rep["tA_qdisc_pkts"] or 0) + (rep["tA_ring_pkts"] or 0)
                rep["tA_queue_ms"] = 1000.0 * q / rate if rate else None
                pt["reps"].append(rep)
                vpn.drain_all()
            r = pt["reps"]
            say(f"s6 {cfg['name']}: p50 {summ(r, 'p50_ms')} ms p99 {summ(r, 'p99_ms')} ms "
                f"bulk {summ(r, 'bulk_mbps')} Mbit/s ring drops {summ(r, 'tx_dropped')}; "
                f"queued at tA: ring {summ(r, 'tA_ring_pkts')} qdisc {summ(r, 'tA_qdisc_pkts')} "
                f"pkts (= {summ(r, 'tA_queue_ms')} ms at {rate} pps); B udp rx "
                f"{summ(r, 'B_udp_rx_kB')} kB, A udp rx {summ(r, 'A_udp_rx_kB')} kB")
            res["points"].append(pt)
    finally:
        if vpn is not None:
            vpn.close()
    return res


# --- driver ------------------------------------------------------------------------
def summ(reps: list[dict], key: str) -> str:
    v = [r[key] for r in reps if isinstance(r.get(key), (int, float))]
    if not v:
        return "-"
    m = statistics.median(v)
    return f"{m:.4g}" if len(v) == 1 else f"{m:.4g} [{min(v):.4g}..{max(v):.4g}]"


class Ctx:
    def __init__(self, a):
        self.quick = a.quick
        self.reps = a.reps
        self.duration = a.duration
        self.tools = a.tools
        self.bp = tl.has_backpressure()

    def dur(self, full: float, quick: float) -> float:
        if self.duration:
            return self.duration
        return quick if self.quick else full


SCENARIOS = {"1": s1_pktgen, "2": s2_vhost, "3": s3_tcp_grid, "4": s4_video,
             "5": s5_parallel, "6": s6_latency}
DEFAULT_ORDER = ["1", "4", "5", "6", "3", "2"]


def main() -> int:
    env = os.environ
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", default=env.get("QUICK", "") not in ("", "0"))
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--duration", type=float, default=float(env.get("DURATION", 0) or 0))
    ap.add_argument("--scenarios", default=env.get("SCENARIOS", ",".join(DEFAULT_ORDER)))
    ap.add_argument("--tools", default=env.get("NODROP_TOOLS", str(REPO / "tools" / "build")))
    ap.add_argument("--results", default=env.get("NODROP_RESULTS") or env.get("NODROP_BENCH_OUT") or ".")
    a = ap.parse_args()
    if a.reps is None:
        a.reps = int(env.get("REPS") or (3 if a.quick else 5))
    out = Path(a.results)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(a)
    missing = [t for t in ("tunreader", "tunnel", "vidstream")
               if not os.access(os.path.join(a.tools, t), os.X_OK)]
    if missing:
        say(f"missing tools in {a.tools}: {missing} (make -C tools OUT=...)")
        return 2
    for tool in ("iperf3", "ping", "tc", "ip"):
        if not shutil.which(tool):
            say(f"warning: {tool} not found")
    uname = os.uname()
    common = {"flavor": env.get("NODROP_FLAVOR", ""), "uname_r": uname.release,
              "uname_v": uname.version, "bp_supported": ctx.bp,
              "features": hex(tl.get_features()), "quick": a.quick, "reps": a.reps,
              "cpus": os.cpu_count(),
              "default_qdisc": Path("/proc/sys/net/core/default_qdisc").read_text().strip()
              if Path("/proc/sys/net/core/default_qdisc").exists() else None}
    say(f"kernel {uname.release}, TUNGETFEATURES {common['features']}, backpressure "
        f"{'supported: measuring stock and bp' if ctx.bp else 'not supported: stock only'}, "
        f"quick={a.quick} reps={a.reps}")
    rc = 0
    started = time.time()
    elapsed: dict[str, float] = {}
    for s in [x.strip() for x in a.scenarios.split(",") if x.strip()]:
        fn = SCENARIOS.get(s)
        if not fn:
            say(f"unknown scenario {s}")
            continue
        t = time.monotonic()
        say(f"scenario {s}: {fn.__name__}")
        try:
            res = fn(ctx)
        except Exception as e:  # noqa: BLE001 - record and go on with the others
            import traceback
            traceback.print_exc()
            res = {"scenario": fn.__name__, "error": f"{type(e).__name__}: {e}", "points": []}
            rc = 1
        res.update(common)
        res["elapsed_s"] = round(time.monotonic() - t, 1)
        name = res.get("scenario", fn.__name__)
        (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        elapsed[name] = res["elapsed_s"]
        say(f"scenario {s} done in {res['elapsed_s']}s -> {out / (name + '.json')}"
            + (f" (skipped: {res['skipped']})" if res.get("skipped") else ""))
    total = round(time.monotonic() - T0, 1)
    # run.json (no "scenario" key: not a scenario) -- how long this took
    (out / "run.json").write_text(json.dumps(
        {**common, "started_unix": round(started), "total_s": total,
         "scenarios_elapsed_s": elapsed, "scenarios": a.scenarios,
         "duration_override_s": a.duration or None}, indent=1) + "\n")
    say(f"all done in {total:.0f}s ({total / 60:.1f} min): "
        + ", ".join(f"{k} {v:.0f}s" for k, v in elapsed.items()))
    return rc


if __name__ == "__main__":
    sys.exit(main())
