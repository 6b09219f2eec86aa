"""Helpers shared by the benchmark scenarios (bench/scenarios/s*.py).

Everything here runs inside the guest, Python 3.11 stdlib only:
network namespaces held by a process, background processes, the VPN path
(two `tools/tunnel` ends over a veth), iperf3, pktgen, the stock/bp
configurations, and the counters the scenarios read in-process (rtnetlink
qdisc stats, tunlib.qstats, /proc): a fork+exec of tc/ss costs about half a second under TCG.

Clock-independent mechanism counters (`mech_snap`/`mech_rates`): queue
stops and wakes per 1000 delivered packets, from qstats tx-stop/tx-wake when
the driver reports them (feature detection, never the kernel name), and the
root qdisc's requeues per 1000 packets; plus the guest time
and per-CPU idle time of the window, from which the report derives guest
instructions per packet under QEMU icount (docs/bench.md, "Clock").
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
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
        # an event with a generous limit: 5 s once failed after a VPN's
        # teardown under icount (2026-11-28); say where the child waits
        deadline = time.monotonic() + 120
        while True:
            try:
                if os.stat(path).st_ino != own:
                    break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"unshare --net did not create a namespace in 120 s "
                                   f"({self._where()})")
            time.sleep(0.01)
        self.fd = os.open(path, os.O_RDONLY)
        with self:
            sh("ip link set lo up")
            sh("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
               "net.ipv6.conf.default.disable_ipv6=1", check=False)

    def _where(self) -> str:
        """The unshare child's state, exit status or kernel wait channel."""
        if self.proc.poll() is not None:
            return f"exited {self.proc.returncode}"
        info = []
        for f in ("wchan", "stack"):
            try:
                info.append(f"{f}: " + Path(f"/proc/{self.proc.pid}/{f}").read_text()
                            .strip().replace("\n", " | "))
            except OSError:
                pass
        return "; ".join(info) or "no wait channel"

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
        """Pipes to and from the process unless kw says otherwise: a process
        that writes more than a pipe holds (64 KiB) must be read, or given
        subprocess.DEVNULL, or it blocks in write()."""
        for k in ("stdin", "stdout", "stderr"):
            kw.setdefault(k, subprocess.PIPE)
        kw.setdefault("text", True)
        p = subprocess.Popen(argv, **kw)
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
        q = tl.nl_root_qdisc(dev)
        if q:
            return q
    except OSError:
        pass
    try:
        return tl.qdisc_totals(dev)
    except Exception:
        return {"kind": "none", "packets": 0, "drops": 0, "qlen": 0, "backlog": 0,
                "requeues": 0}


# --- cheap in-process probes ------------------------------------------------------
# tc/ss are a fork+exec each, about half a second under TCG with the benchmark
# running: too slow and too disturbing to sample a standing queue with. These
# read the same counters from /proc in the calling netns (qdisc counters:
# tunlib.nl_root_qdisc(), rtnetlink).


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


# --- mechanism counters and the guest clock ------------------------------------
USER_HZ = os.sysconf("SC_CLK_TCK")


def stops_wakes(dev: str) -> tuple[str | None, int, int]:
    """Queue stops and wakes of dev from qstats tx-stop/tx-wake (device
    scope: queues detached since included); (None, 0, 0) when the driver
    reports no queue statistics (stock 6.12, mainline 7.3)."""
    q = tl.qstats(dev)
    if q is None:
        return None, 0, 0
    return "qstats", q["total"]["stop"], q["total"]["wake"]


def cpu_idle_ns() -> list[int]:
    """Idle (+ iowait) time per CPU from /proc/stat, in ns of the guest clock."""
    out = []
    with open("/proc/stat") as f:
        for line in f:
            p = line.split()
            if p[0].startswith("cpu") and p[0] != "cpu":
                out.append((int(p[4]) + int(p[5])) * 1_000_000_000 // USER_HZ)
    return out


def softirqs() -> dict[str, int]:
    """NET_TX and NET_RX softirqs run so far, all CPUs (/proc/softirqs):
    NET_TX is a qdisc run some CPU owed a wake-up or a requeue, NET_RX a
    backlog/NAPI run (a tun write, a veth or loopback receive)."""
    out = {"net_tx": 0, "net_rx": 0}
    with open("/proc/softirqs") as f:
        for line in f:
            p = line.split()
            if p and p[0] in ("NET_TX:", "NET_RX:"):
                out[p[0][:-1].lower()] = sum(int(x) for x in p[1:])
    return out


def task_cpu_ns(pid: int, tid: int | None = None) -> int:
    """CPU time of process pid (or of its thread tid) so far (utime + stime,
    /proc/<pid>/stat), in ns of the guest clock; softirqs that ran in its
    context included (the lab's kernels have no IRQ time accounting)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as f:
        p = f.read().rsplit(")", 1)[1].split()
    return (int(p[11]) + int(p[12])) * 1_000_000_000 // USER_HZ


def task_sleeps(pid: int, tid: int | None = None) -> int:
    """Voluntary context switches of pid (or its thread tid): how often it
    went to sleep (waiting for packets, for a wake-up, for a timer)."""
    path = f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def vhost_worker(owner: int) -> tuple[int, int] | None:
    """(pid, tid) of the vhost worker serving process owner: a thread
    "vhost-<owner>" of that process (vhost_task, 6.4 on), else a kernel
    thread of that name; None if there is none."""
    name = f"vhost-{owner}"
    for tid in os.listdir(f"/proc/{owner}/task"):
        try:
            with open(f"/proc/{owner}/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    return owner, int(tid)
        except FileNotFoundError:
            continue
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    return int(pid), int(pid)
        except FileNotFoundError:
            continue
    return None


def mech_snap(dev: str, consumer_pid: int | None = None, reader: dict | None = None,
              vhost: tuple[int, int] | None = None) -> dict:
    """Counters of dev at one instant (in the caller's netns), for
    mech_rates(): guest time, per-CPU idle, packets the consumer took from
    the ring (tx_packets), root qdisc requeues, queue stops/wakes, NET_TX and
    NET_RX softirqs; the CPU time and sleeps of the consumer process if
    given; the reader tool's own counters (`stat` of tunreader: read()
    calls, poll wake-ups; of vhostrx: used-ring signals from vhost-net);
    and the vhost worker thread's CPU time and sleeps."""
    st = tl.dev_stats(dev)
    q = qdisc_counts(dev)
    src, stops, wakes = stops_wakes(dev)
    out = {"t_ns": time.monotonic_ns(), "idle_ns": cpu_idle_ns(),
           "tx_packets": st["tx_packets"], "requeues": q.get("requeues", 0),
           "sw_src": src, "stops": stops, "wakes": wakes, **softirqs()}
    if consumer_pid:
        out["consumer_ns"] = task_cpu_ns(consumer_pid)
        out["consumer_sleeps"] = task_sleeps(consumer_pid)
    for k in ("reads", "wakeups", "signals"):
        if reader and isinstance(reader.get(k), int):
            out[f"reader_{k}"] = reader[k]
    if vhost:
        out["vhost_ns"] = task_cpu_ns(*vhost)
        out["vhost_sleeps"] = task_sleeps(*vhost)
    return out


# counts per 1000 delivered packets: mech_snap key -> mech_rates key
PER_KPKT = {"requeues": "requeues_per_kpkt", "net_tx": "net_tx_per_kpkt",
            "net_rx": "net_rx_per_kpkt", "consumer_sleeps": "reader_sleeps_per_kpkt",
            "reader_reads": "reads_per_kpkt", "reader_wakeups": "reader_wakeups_per_kpkt",
            "reader_signals": "vhost_signals_per_kpkt", "vhost_sleeps": "vhost_sleeps_per_kpkt"}


def mech_rates(m0: dict, m1: dict, seconds: float | None = None) -> dict:
    """Per window: delivered packets; the PER_KPKT counts per 1000
    delivered packets and queue stops/wakes likewise (any clock); the
    consumer process's and the vhost worker's share of one CPU (*_cpu_pct)
    and CPU time per delivered packet (*_ns_per_pkt); and guest ns per
    delivered packet, gns_per_pkt (under icount shift=0: guest
    instructions, both vCPUs together, upper bound) with gns_per_pkt_lo
    (the same minus the least idle time of any vCPU: lower bound).
    `seconds` replaces the window's length for the per-packet cost (iperf3:
    the transfer only)."""
    n = m1["tx_packets"] - m0["tx_packets"]
    t = m1["t_ns"] - m0["t_ns"]
    idle = min((b - a for a, b in zip(m0["idle_ns"], m1["idle_ns"])), default=0)
    idle_frac = min(1.0, max(0.0, idle / t)) if t > 0 else 0.0
    span = seconds * 1e9 if seconds else t
    out = {"pkts": n, "guest_s": t / 1e9, "idle_min_pct": 100.0 * idle_frac,
           "gns_per_pkt": span / n if n else None,
           "gns_per_pkt_lo": span * (1 - idle_frac) / n if n else None,
           "sw_src": m1["sw_src"]}
    for k, name in PER_KPKT.items():
        if k in m0 and k in m1:
            out[name] = 1000.0 * (m1[k] - m0[k]) / n if n else None
    for k, name in (("consumer_ns", "consumer"), ("vhost_ns", "vhost")):
        if k in m0 and k in m1 and t > 0 and n:
            c = m1[k] - m0[k]
            out[f"{name}_cpu_pct"] = 100.0 * c / t
            out[f"{name}_ns_per_pkt"] = c / n
    if m1["sw_src"] and m1["sw_src"] == m0["sw_src"] and n:
        out["stops_per_kpkt"] = 1000.0 * (m1["stops"] - m0["stops"]) / n
        out["wakes_per_kpkt"] = 1000.0 * (m1["wakes"] - m0["wakes"]) / n
    return out


# --- configurations ------------------------------------------------------------
def configs(ctx, qlen: int | None = None, control: bool = False,
            nobql: bool = True) -> list[dict]:
    """stock: no flag, the device's default qdisc; stock+fq_codel (control):
    no flag, fq_codel root, the control for bp's qdisc work; bp:
    IFF_BACKPRESSURE + fq_codel (default parameters: real AQM), only where
    the kernel has it; bp-nobql (nobql): bp with BQL off (bql_switch()),
    only where tun has the "bql" private flag."""
    c = [{"name": "stock", "flag": 0, "qdisc": None, "qlen": qlen}]
    if control:
        c.append({"name": "stock+fq_codel", "flag": 0, "qdisc": "fq_codel", "qlen": qlen})
    if ctx.bp:
        c.append({"name": "bp", "flag": BP, "qdisc": "fq_codel", "qlen": qlen})
    if ctx.bp and ctx.bql and nobql:
        c.append({"name": "bp-nobql", "flag": BP, "qdisc": "fq_codel", "qlen": qlen,
                  "bql": "off"})
    return c


def apply_dev(dev: str, cfg: dict) -> str:
    if cfg.get("qlen"):
        sh(f"ip link set dev {dev} txqueuelen {cfg['qlen']}")
    if cfg.get("qdisc"):
        sh(f"tc qdisc replace dev {dev} root {cfg['qdisc']}")
    return qdisc_counts(dev)["kind"]


class Sysfs:
    """The sysfs of one network namespace, read and written without forking:
    /sys shows the netns it was mounted in, so a helper process in that
    netns mounts its own in a private mount namespace, and we go through
    /proc/<helper>/root. Spawn it inside the namespace (`with ns:`)."""

    def __init__(self, procs: "Procs"):
        self.proc = procs.spawn(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                 "mount -t sysfs sysfs /sys && echo ready && exec sleep 100000"])
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("could not mount a sysfs for the namespace: "
                               f"{self.proc.stderr.read()}")

    def path(self, rel: str) -> str:
        return f"/proc/{self.proc.pid}/root/sys/{rel}"

    def read_int(self, rel: str) -> int | None:
        try:
            with open(self.path(rel)) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return None

    def write(self, rel: str, value) -> None:
        with open(self.path(rel), "w") as f:
            f.write(str(value))


BQL_DIR = "class/net/{dev}/queues/tx-0/byte_queue_limits"


def bql_state(fs: Sysfs, dev: str) -> dict | None:
    """Queue 0's BQL limit and bytes in flight, None without byte_queue_limits."""
    d = BQL_DIR.format(dev=dev)
    limit = fs.read_int(f"{d}/limit")
    if limit is None:
        return None
    return {"limit": limit, "inflight": fs.read_int(f"{d}/inflight")}


def bql_switch(dev: str, off: bool) -> None:
    """off: "ours without BQL", tun's "bql" ethtool private flag off (the
    queue stops at the ring's level only, nothing accounted); else BQL as
    the kernel has it (the flag on, its default). Run in the device's netns.
    Lifting BQL's limit through sysfs (limit_min) is not the same: DQL's
    room is also the qdisc's bulk dequeue budget, which then hands the
    whole backlog over at once."""
    if tl.has_priv_flag(dev, "bql"):
        tl.set_priv_flag(dev, "bql", not off)
    elif off:
        raise RuntimeError(f"{dev}: no 'bql' ethtool private flag: bp-nobql cannot be "
                           "configured on this kernel")


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
        with self.a:
            self.fs_a = Sysfs(self.procs)
        with self.b:
            self.fs_b = Sysfs(self.procs)
        self.apply_bql(cfg)
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
        self.apply_bql(cfg)

    def apply_bql(self, cfg: dict):
        """cfg["bql"] == "off": "ours without BQL" on both tuns
        (bql_switch()); otherwise BQL as the kernel has it."""
        for ns, dev in ((self.a, "tA"), (self.b, "tB")):
            with ns:
                bql_switch(dev, cfg.get("bql") == "off")

    def iperf_server(self, port: int = 5201) -> subprocess.Popen:
        """One iperf3 server per VPN (nsB), reused by every test."""
        srv = getattr(self, "_srv", None)
        if srv is not None and srv.poll() is None:
            return srv
        with self.b:
            # its report of every test goes nowhere: nothing reads it, and
            # once it filled the pipe the server blocked in write() in the
            # middle of a test (s5, after about a dozen 8-stream tests)
            srv = self._srv = self.procs.spawn(["iperf3", "-s", "-B", TUN_B, "-p", str(port)],
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL)
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
            m = mech_snap("tA")
        return {"tx_dropped": s["tx_dropped"], "tx_packets": s["tx_packets"],
                "qdisc_drops": q["drops"], "qdisc_sent": q["packets"],
                "qdisc_qlen": q["qlen"], "mech": m}

    def probe(self) -> dict:
        """Where packets wait, per side, without forking: root qdisc backlog,
        packets in the tun ring (qdisc sent - read by the tunnel - ring
        drops: a difference against an idle probe gives the occupancy),
        and the tunnel's UDP socket queues in bytes."""
        out = {"t": time.monotonic()}
        for ns, dev, side in ((self.a, "tA", "A"), (self.b, "tB", "B")):
            with ns:
                q = tl.nl_root_qdisc(dev)
                st = tl.dev_stats(dev)
                utx, urx = udp_queues()
            out[side] = {"q_pkts": q.get("qlen", 0), "read": st["tx_packets"],
                         "ring_x": q.get("packets", 0) - st["tx_packets"] - st["tx_dropped"],
                         "udp_tx": utx, "udp_rx": urx,
                         "bql": bql_state(self.fs_a if side == "A" else self.fs_b, dev)}
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
        while time.monotonic() < end:
            with self.a:
                if not qdisc_counts("tA")["qlen"]:
                    return
            time.sleep(0.1)

    def close(self):
        self.procs.close()
        self.a.close()
        self.b.close()


def delta(c0: dict, c1: dict, seconds: float | None = None) -> dict:
    """Drops of tA between two VPN.counters(), and its mechanism rates."""
    out = {k: c1[k] - c0[k] for k in ("tx_dropped", "qdisc_drops")}
    out.update(mech_rates(c0["mech"], c1["mech"], seconds))
    return out


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


def _hung(procs: dict[str, subprocess.Popen]) -> dict:
    """Where the processes of a test that timed out are: their wait channel
    ("0": running) and the share of a CPU each used over one second of guest
    time (a spin, or a wait)."""
    def cpu(p):
        try:
            return task_cpu_ns(p.pid)
        except OSError:
            return None
    a = {k: cpu(p) for k, p in procs.items()}
    time.sleep(1)
    out = {}
    for k, p in procs.items():
        b = cpu(p)
        try:
            wchan = Path(f"/proc/{p.pid}/wchan").read_text()
        except OSError:
            wchan = "gone"
        out[k] = {"wchan": wchan,
                  "cpu_share": None if a[k] is None or b is None else round((b - a[k]) / 1e9, 2)}
    return out


def iperf_finish(vpn: VPN, h) -> dict:
    srv, cli, c0, duration = h
    hung = None
    try:
        stdout, stderr = cli.communicate(timeout=duration * 10 + 120)
    except subprocess.TimeoutExpired:
        hung = _hung({"client": cli, "server": srv})
        cli.kill()
        stdout, stderr = cli.communicate()
        # the server may still be inside the dead test: the next test of
        # this VPN gets a new one (iperf_server()) instead of hanging too
        srv.kill()
        srv.wait()
    c1 = vpn.counters()
    try:
        end = json.loads(stdout)["end"]
        out = {"mbps": end["sum_received"]["bits_per_second"] / 1e6,
               "mbps_sent": end["sum_sent"]["bits_per_second"] / 1e6,
               "retransmits": end["sum_sent"].get("retransmits", 0),
               "transfer_s": end["sum_received"].get("seconds")}
    except Exception as e:  # noqa: BLE001
        out = {"error": f"iperf3 rc={cli.returncode} {e}: {stdout[-300:]} {stderr[-300:]}"}
    if hung:
        out["hung"] = hung
    # per-packet cost over the transfer (guest seconds iperf3 measured), not
    # over the window with process start and control exchange
    out.update(delta(c0, c1, out.get("transfer_s")))
    return out


def iperf(vpn: VPN, duration: float, streams: int = 1) -> dict:
    return iperf_finish(vpn, iperf_start(vpn, duration, streams))




# --- pktgen ------------------------------------------------------------------------
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


def pktgen_available() -> str | None:
    """None when /proc/net/pktgen is there, else why not."""
    if not os.path.isdir(PG):
        subprocess.run(["modprobe", "pktgen"], capture_output=True, check=False)
    return None if os.path.isdir(PG) else "no /proc/net/pktgen in this kernel"


def pktgen_setup(dev: str, threads: int, mode: str, udp_dst: tuple[int, int] = (9, 9)) \
        -> list[str] | None:
    """64-byte UDP frames to tunlib's peer on dev, `count 0` (until stopped),
    one device per kernel thread; the /proc paths of the devices, None when
    the kernel has fewer pktgen threads than asked for."""
    ths = sorted(n for n in os.listdir(PG) if n.startswith("kpktgend_"))[:threads]
    if len(ths) < threads:
        return None
    # udp_dst is inclusive; pktgen's udp_dst_max is exclusive when it steps
    # through a range (net/core/pktgen.c: cur >= max wraps to min), so
    # (9, 10) must be written as 9..11 or port 10 is never sent
    udp_dst_max = udp_dst[1] + 1 if udp_dst[1] > udp_dst[0] else udp_dst[1]
    devs = []
    for i, th in enumerate(ths):
        pg_write(f"{PG}/{th}", "rem_device_all")
        name = dev if threads == 1 else f"{dev}@{i}"
        pg_write(f"{PG}/{th}", f"add_device {name}")
        dp = f"{PG}/{name}"
        for c in ("count 0", "pkt_size 64", "clone_skb 0", "burst 1",
                  "delay 0", f"xmit_mode {mode}", f"dst {tl.PEER_IP}",
                  f"src_min {tl.LOCAL_IP}", f"src_max {tl.LOCAL_IP}",
                  f"dst_mac {tl.PEER_MAC}", f"udp_dst_min {udp_dst[0]}",
                  f"udp_dst_max {udp_dst_max}"):
            pg_write(dp, c)
        devs.append(dp)
    return devs


def stop_pktgen(start: subprocess.Popen) -> None:
    """Stop pktgen and wait for the `echo start` writer to return.  A "stop"
    written before that writer reached pktgen is lost (count 0 then runs
    forever: mainline-7.3's s1 hung so in the 25 Nov full run), so write it
    again until the writer returns."""
    for _ in range(60):
        pg_write(f"{PG}/pgctrl", "stop")
        try:
            start.wait(timeout=2)
            return
        except subprocess.TimeoutExpired:
            continue
    raise RuntimeError("pktgen did not stop within 120 s of repeated stop commands")


BQL_SAMPLES = 8     # samples of queue 0's BQL state per pktgen window


_MARK = None


def mark(code: int) -> None:
    """With NODROP_BENCH_MARK=1, execute bench/insnprof's mark instruction
    (nopl 0x4e4f5000+code(%rax,%rax,1)): the QEMU plugin snapshots its
    per-block instruction counts there. Without it, nothing."""
    global _MARK
    if not os.environ.get("NODROP_BENCH_MARK"):
        return
    import ctypes
    import mmap
    if _MARK is None:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        _MARK = (page, ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(page))))
    page, fn = _MARK
    page.seek(0)
    page.write(b"\x0f\x1f\x84\x00" + (0x4e4f5000 + code).to_bytes(4, "little") + b"\xc3")
    fn()


def pktgen_reps(dev: str, devs: list[str], snap, reps: int, duration: float,
                warmup: float, bql=None) -> list[dict]:
    """`reps` windows of `duration` s after `warmup` s of pktgen: every
    numeric field of snap() as a rate (<name>_per_s); snap()'s "mech" (a
    mech_snap) as mech_rates(); the ring and qdisc drained between reps.
    bql: a bql_state() sampler; its limit and inflight, sampled BQL_SAMPLES
    times across the window, as bql_limit/bql_inflight (median) and
    bql_limit_max."""
    out = []
    retries = 2     # windows in which pktgen sent nothing, measured again
    while len(out) < reps:
        start = subprocess.Popen(["sh", "-c", f"echo start > {PG}/pgctrl"])
        time.sleep(warmup)
        s0 = snap()
        mark(2 * len(out))
        samples, n = [], BQL_SAMPLES if bql else 1
        for _ in range(n):
            time.sleep(duration / n)
            if bql:
                samples.append(bql() or {})
        s1 = snap()
        mark(2 * len(out) + 1)
        stop_pktgen(start)
        if retries and "pg_sent" in s1 and s1["pg_sent"] == s0["pg_sent"] and \
                s1.get("pg_errors") == s0.get("pg_errors"):
            # seen once in 25 Nov's run (s2, vhost, 2 threads): pktgen did
            # not run in the window at all, neither sent nor failed a packet
            # ("already stopped" in dmesg): nothing the device did, so
            # measure the window again (a stalled queue would show as
            # pktgen errors, or as sent packets nobody received)
            retries -= 1
            say("   pktgen did not run in this window: measuring it again")
            continue
        dt = (s1["mech"]["t_ns"] - s0["mech"]["t_ns"]) / 1e9
        rep = {k + "_per_s": (s1[k] - s0[k]) / dt for k in s1
               if isinstance(s1[k], (int, float)) and k != "bad"}
        rep["seconds"] = dt
        rep["bad"] = s1.get("bad", 0)
        rep.update(mech_rates(s0["mech"], s1["mech"]))
        limits = [x["limit"] for x in samples if x.get("limit") is not None]
        if limits:
            rep["bql_limit"] = statistics.median(limits)
            rep["bql_limit_max"] = max(limits)
            rep["bql_inflight"] = statistics.median(x.get("inflight") or 0 for x in samples)
        out.append(rep)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end and qdisc_counts(dev)["qlen"]:
            time.sleep(0.2)
    return out


def no_qdisc_bypass(dev: str, kind: str) -> None:
    """Take the root qdisc's empty-queue bypass away: the core sends a
    packet straight to the driver when the qdisc is empty and can bypass
    (TCQ_F_CAN_BYPASS), skipping its enqueue and dequeue; any filter on the
    qdisc clears that flag (cls_api). One matchall filter with classid 1:1
    puts every packet in flow 1 of an fq_codel (pktgen sends one flow)."""
    sh(f"tc qdisc replace dev {dev} root handle 1: {kind}")
    sh(f"tc filter add dev {dev} parent 1: matchall classid 1:1")


def pktgen_point(tools: str, cfg: dict, threads: int, mode: str, vnet: bool,
                 reps: int, duration: float, warmup: float,
                 consumer: str = "tunreader", bypass: bool = True) -> dict:
    """One point of s1/s2: tap pg0 (ring 500) in its own netns, read by
    tunreader (plain or with a 12-byte vnet header) or vhostrx; bypass
    False: every packet goes through the qdisc (no_qdisc_bypass())."""
    ns = NS("pg")
    procs = Procs()
    point = {"config": cfg["name"], "threads": threads, "xmit_mode": mode,
             "reader": "vnet_hdr" if vnet else "plain",
             "qdisc_bypass": "yes" if bypass else "no", "reps": []}
    try:
        with ns:
            flags = IFF_TAP | IFF_NO_PI | cfg["flag"] | (IFF_VNET_HDR if vnet else 0)
            argv = [os.path.join(tools, consumer), "--dev", "pg0", "--flags", hex(flags)]
            if consumer == "tunreader":
                argv += ["--tap"] + (["--vnet-hdr", "12"] if vnet else [])
            reader = tl.Reader(procs.spawn(argv, text=False), "pg0")
            # tunreader reads in its own context; vhost-net pulls from the
            # ring in its worker thread (vhost-<pid of vhostrx>)
            reader_pid = reader.proc.pid if consumer == "tunreader" else None
            vhost = None if reader_pid else vhost_worker(reader.proc.pid)
            tl.setup_ip("pg0", tap=True, txqueuelen=cfg.get("qlen") or 500)
            point["qdisc"] = apply_dev("pg0", cfg)
            if not bypass:
                no_qdisc_bypass("pg0", cfg["qdisc"])
            fs = Sysfs(procs)
            bql_switch("pg0", cfg.get("bql") == "off")
            devs = pktgen_setup("pg0", threads, mode)
            if devs is None:
                point["error"] = f"fewer than {threads} pktgen threads"
                return point

            def snap():
                r = reader.stat()
                s = tl.dev_stats("pg0")
                pg = [pg_counts(d) for d in devs]
                return {"recv": r["pkts"], "tx_dropped": s["tx_dropped"],
                        "qdisc_drops": qdisc_counts("pg0")["drops"],
                        "pg_sent": sum(x[0] for x in pg),
                        "pg_errors": sum(x[1] for x in pg), "bad": r["bad"],
                        "mech": mech_snap("pg0", reader_pid, r, vhost)}
            # every configuration does the same sampling work (None where
            # the kernel shows no byte_queue_limits)
            point["reps"] = pktgen_reps("pg0", devs, snap, reps, duration, warmup,
                                        lambda: bql_state(fs, "pg0"))
            reader.quit()
    finally:
        procs.close()
        ns.close()
    return point


# --- summaries and the run context ---------------------------------------------------
def summ(reps: list[dict], key: str) -> str:
    v = [r[key] for r in reps if isinstance(r.get(key), (int, float))]
    if not v:
        return "-"
    m = statistics.median(v)
    return f"{m:.4g}" if len(v) == 1 else f"{m:.4g} [{min(v):.4g}..{max(v):.4g}]"


def pct(vals: list[float], p: float) -> float | None:
    if not vals:
        return None
    v = sorted(vals)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def say_pktgen(tag: str, pt: dict) -> None:
    r = pt["reps"]
    say(f"   {tag}: recv {summ(r, 'recv_per_s')} pps, ring drops "
        f"{summ(r, 'tx_dropped_per_s')}/s, qdisc drops {summ(r, 'qdisc_drops_per_s')}/s, "
        f"guest ns/pkt {summ(r, 'gns_per_pkt')}, stops/kpkt {summ(r, 'stops_per_kpkt')}, "
        f"requeues/kpkt {summ(r, 'requeues_per_kpkt')}, NET_TX/kpkt {summ(r, 'net_tx_per_kpkt')}"
        + (f", reader CPU {summ(r, 'consumer_cpu_pct')} % = {summ(r, 'consumer_ns_per_pkt')} ns/pkt"
           if any("consumer_cpu_pct" in x for x in r) else "")
        + (f", BQL limit {summ(r, 'bql_limit')} B (max {summ(r, 'bql_limit_max')}) "
           f"inflight {summ(r, 'bql_inflight')} B" if any("bql_limit" in x for x in r) else ""))


def has_bql() -> bool:
    """A tun with backpressure has the "bql" private flag (our kernels: BQL
    under backpressure, switchable)."""
    t = tl.Tun("ndbqlprobe", IFF_TUN | IFF_NO_PI | BP)
    try:
        return tl.has_priv_flag(t.name, "bql")
    finally:
        t.close()


class Ctx:
    """What every scenario gets: QUICK, REPS, DURATION override, tools
    directory, and whether the kernel has IFF_BACKPRESSURE."""

    def __init__(self, quick: bool, reps: int, duration: float, tools: str):
        self.quick = quick
        self.reps = reps
        self.duration = duration
        self.tools = tools
        self.bp = tl.has_backpressure()
        self.bql = self.bp and has_bql()
        if tl.declares("bql") and not self.bql:
            raise RuntimeError("the flavor declares bql, but a tun with backpressure has "
                               "no 'bql' private flag: bp-nobql cannot be configured")

    def dur(self, full: float, quick: float) -> float:
        if self.duration:
            return self.duration
        return quick if self.quick else full
