"""NODROP chaos run, inside one guest (docs/chaos.md).

Overloads the queues of one multi-queue tap from several UDP senders while a
chaos loop, at random (seeded, printed, reproducible), pauses and resumes the
consumers, closes and reopens queue fds of the persistent device, detaches and
attaches queues (TUNSETQUEUE), detaches and attaches the vhost-net backend,
resizes txqueuelen, changes the MTU, sets the link down and up, swaps the root qdisc
(fq_codel, pfifo, mq, noqueue), toggles backpressure by reopening every queue
and, where the device has it, with the ethtool private flag, and switches
byte queue limits off and on with the "bql" private flag where it exists.

Consumers: two tools/tunreader processes and, when /dev/vhost-net exists, one
tools/vhostrx (vhost-net RX), each on its own queue.

Checks, after the chaos stops:
  * ring_drops  - tx_dropped did not move during any steady window in which
                  backpressure was on (the program's IFF_BACKPRESSURE, as
                  TUNGETIFF reports it, or the operator's private flag, as
                  this run last set it), the root qdisc was not
                  noqueue, the link was up and a queue was attached
  * drain       - with everything resumed and attached, the qdisc backlog and
                  the consumers go quiet (no stall: see tunlib.wait_backlog_zero)
  * burst       - a fresh burst is delivered completely to the consumers
  * splats      - the kernel log of the whole boot has no KASAN / KCSAN /
                  lockdep / WARNING / BUG / stall report involving tun, tap,
                  vhost or ptr_ring (every other report is listed too)
  * kmemleak    - after the device is gone, no leak whose backtrace involves
                  tun, tap, vhost or ptr_ring (others are listed)

Feature detection only: backpressure via TUNGETFEATURES & 0x0080, the
private flag via ethtool --show-priv-flags. Without backpressure the ring_drops
check has no protected window and passes vacuously (drops are reported).

Run by tests/chaos/test_chaos.py (pytest, `make test`, `make chaos`), or by
hand: tests/chaos/run --duration 60 --seed 1 (as root, in a guest).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "guest"))
import tunlib as tl  # noqa: E402

DEV = "chaos0"
BASE_FLAGS = tl.IFF_TAP | tl.IFF_NO_PI | tl.IFF_MULTI_QUEUE
QLENS = [1, 2, 10, 64, 100, 500, 1000]
MTUS = [1280, 1500, 4000, 9000]    # the senders' 600 B datagrams fit each
# actions that leave the device state alone (queues stay attached, flag,
# qdisc and link stay): the time they take counts as a steady window too.
# Not qlen: a txqueuelen change deactivates the qdisc (noop_enqueue counts
# tx_dropped) for a moment, in the core, for every device. An MTU change
# does not touch the qdisc: it keeps protection.
KEEPS_PROTECTION = ("pause", "backend", "bql", "mtu")
QDISC_WEIGHT = {"fq_codel": 3, "pfifo": 2, "noqueue": 1, "mq": 2}
UNQUEUED = ("noqueue", "noop", "none")     # root "qdiscs" that hold nothing
QDISCS = {"fq_codel": tl.FQ_CODEL_ARGS, "pfifo": "pfifo limit 1000",
          "noqueue": "noqueue", "mq": None}
SNDBUF = 4 << 20
# Rates are low on purpose: under TCG (and KASAN) senders at full speed starve
# the chaos loop of CPU. A consumer is slower than what the senders put on its
# queue, and a paused one fills its ring in well under a second.
SENDER_PPS = 1000           # each of the two senders
READER_DELAY_US = 1000      # tunreader: at most 1000 packets/s
VHOST_RATE = 500            # vhostrx: packets per second
BURST = 300                 # the fresh burst after the chaos
BURST_ID = 9
STALL_S = 60.0
KMEMLEAK = "/sys/kernel/debug/kmemleak"

# Kernel reports that count as a splat (one line starts each report).
SPLAT_RE = re.compile(
    r"BUG:|WARNING:|UBSAN:|kernel BUG|Oops|general protection|"
    r"possible circular locking|possible recursive locking|inconsistent lock state|"
    r"suspicious RCU usage|sleeping function called from invalid context|"
    r"INFO: task .* blocked|rcu_.*(self-)?detected stall|soft lockup|hard LOCKUP|"
    r"Workqueue .* hung|unreferenced object|list_(add|del) corruption")
OURS_RE = re.compile(r"(?<![A-Za-z0-9])_*(tun|tap|vhost|ptr_ring)(_|\.c\b)")
# Known, non-splat kernel message: the qdisc was swapped to noqueue while
# backpressure had the queue stopped (docs/chaos.md, "Reading a failed round").
NOQUEUE_MSG = "asks to queue packet"


def say(msg: str) -> None:
    print(f"[chaos {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


T0 = time.monotonic()


class DropSites:
    """Where the kernel freed dropped skbs, by function and drop reason: a
    hist trigger on the skb:kfree_skb tracepoint (keys: the caller's symbol
    and the reason), read at every snapshot. Tells a bad window's drops
    apart: tun_net_xmit's (a ring full, no ring at the index, a filter) from
    the core's (__dev_queue_xmit, on 7.x __tcf_kfree_skb_list: the noop
    qdisc of a deactivated device, or the qdisc's own limit, which `tc -s`
    counts). Needs tracefs with
    hist triggers (the debug flavors have them); absent, every read is
    None and the reports say so."""
    EVENT = "/sys/kernel/tracing/events/skb/kfree_skb"
    TRIGGER = "hist:keys=location.sym,reason:vals=hitcount:size=1024"
    LINE = re.compile(r"location:\s*\[[0-9a-f]+\]\s*(\S+).*?reason:\s*(\d+).*?hitcount:\s*(\d+)")

    def __init__(self):
        self.ok = False
        self.reasons: dict[int, str] = {}
        if not os.path.isdir("/sys/kernel/tracing/events"):
            subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"],
                           capture_output=True, check=False)
        try:
            with open(f"{self.EVENT}/format") as f:
                fmt = f.read()
        except OSError:
            return
        try:
            with open(f"{self.EVENT}/trigger", "w") as f:
                f.write(self.TRIGGER)
        except OSError:
            pass    # no hist triggers, or this boot's earlier run set it (EEXIST)
        self.ok = "hitcount" in self._hist()
        # the reasons' names, from the event's print format (__print_symbolic)
        self.reasons = {int(n): name for n, name in re.findall(r'\{\s*(\d+),\s*"(\w+)"\s*\}', fmt)}

    def read(self) -> dict[str, int] | None:
        """Drops so far, "<function> <REASON>" -> count (None: no hist)."""
        if not self.ok:
            return None
        out: dict[str, int] = {}
        for fn, reason, n in self.LINE.findall(self._hist()):
            key = f"{fn} {self.reasons.get(int(reason), reason)}"
            out[key] = out.get(key, 0) + int(n)
        return out

    def _hist(self) -> str:
        try:
            with open(f"{self.EVENT}/hist") as f:
                return f.read()
        except OSError:
            return ""

    @staticmethod
    def delta(a: dict | None, b: dict | None) -> dict | None:
        if a is None or b is None:
            return None
        return {k: v - a.get(k, 0) for k, v in b.items() if v != a.get(k, 0)}


@dataclass
class Slot:
    """One queue of the device and its consumer process."""
    idx: int
    kind: str                       # "tun" (tunreader) or "vhost" (vhostrx)
    tun: tl.Tun | None = None
    rx: tl.Reader | None = None
    attached: bool = True
    paused: bool = False
    backend: bool = True            # vhost: backend set
    delivered: dict = field(default_factory=dict)   # per_id totals of closed consumers


class Chaos:
    def __init__(self, tools: str, seed: int):
        self.rng = random.Random(seed)
        self.seed = seed
        self.env = tl.Env(tl.Tools(tools), tl.has_backpressure())
        self.bp_supported = self.env.bp
        self.vhost = os.path.exists("/dev/vhost-net") and \
            os.access(self.env.tools.path("vhostrx"), os.X_OK)
        self.flags = BASE_FLAGS | self.env.bp_flag()
        self.slots: list[Slot] = []
        self.senders: list[tl.Sender] = []
        self.privflag = False           # the device has the operator switch
        self.admin_on = False           # ... and this run last switched it on
        self.link_up = True
        self.qdisc_kind = "fq_codel"    # what the kernel reports after the last swap
        self.events: list[dict] = []
        self.windows = {"protected": 0, "unprotected": 0, "protected_s": 0.0,
                        "protected_drops": 0, "unprotected_drops": 0,
                        "transition_drops": {}, "bad_windows": []}
        self.result: dict = {"seed": seed}
        self.drop_sites = DropSites()

    # --- device and consumers -------------------------------------------------
    def open_slot(self, s: Slot) -> None:
        # A new queue of a device that has queues asks for what the device
        # has (TUNGETIFF): as on mainline, a multi-queue device keeps the
        # IFF_BACKPRESSURE its first queue set.  The operator switch is a
        # separate bit and does not change what TUNGETIFF reports.
        flags = self.flags
        if any(o.tun is not None for o in self.slots):
            flags = BASE_FLAGS | (tl.IFF_BACKPRESSURE if self.program_bp() else 0)
        s.tun = self.env.tun(DEV, flags)
        label = f"q{s.idx}-{s.kind}"
        if s.kind == "vhost":
            s.rx = self.env.vhostrx(s.tun, rate=VHOST_RATE, label=label)
            s.rx.go()
        else:
            s.rx = self.env.reader(s.tun, tap=True, delay_us=READER_DELAY_US, label=label)
            s.rx.go()
        s.attached, s.paused, s.backend = True, False, True

    def close_slot(self, s: Slot) -> None:
        if s.rx is not None:
            r = s.rx.quit()
            for i, n in enumerate(r.get("per_id", [])):
                s.delivered[i] = s.delivered.get(i, 0) + n
            s.rx = None
        if s.tun is not None:
            s.tun.close()
            self.env.tuns.remove(s.tun)
            s.tun = None

    def program_bp(self) -> bool:
        """IFF_BACKPRESSURE as TUNGETIFF reports it (the programs' bit)."""
        for s in self.slots:
            if s.tun is not None:
                return bool(s.tun.get_iff() & tl.IFF_BACKPRESSURE)
        return False

    def kernel_bp(self) -> bool:
        """Backpressure in effect: the programs' bit or the operator's."""
        return self.program_bp() or self.admin_on

    def setup(self) -> None:
        kinds = ["tun", "tun"] + (["vhost"] if self.vhost else [])
        self.slots = [Slot(i, k) for i, k in enumerate(kinds)]
        first = self.env.tun(DEV, self.flags)
        first.set_persist(True)
        self.env.persistent.append((DEV, self.flags))
        tl.setup_ip(DEV, tap=True, txqueuelen=100)
        first.close()
        self.env.tuns.remove(first)
        for s in self.slots:
            self.open_slot(s)
        tl.set_fq_codel(DEV)
        self.privflag = tl.has_priv_flag(DEV, "backpressure")
        self.bqlflag = tl.has_priv_flag(DEV, "bql")
        self.bql_on = True              # the "bql" private flag's default
        src = tl.LOCAL_IP
        # sender 1: one flow (one queue overloaded); sender 2: 16 flows (all)
        self.senders = [
            self.env.sender(0, size=600, ident=1, sport=20000, flows=1, sndbuf=SNDBUF,
                            pps=SENDER_PPS, label="one-flow"),
            self.env.sender(0, size=600, ident=2, sport=21000, flows=16, sndbuf=SNDBUF,
                            pps=SENDER_PPS, label="16-flows"),
        ]
        say(f"device {DEV}: {len(self.slots)} queues ({', '.join(kinds)}), "
            f"flags {tl.flag_names(self.flags)}, backpressure "
            f"{'supported' if self.bp_supported else 'not supported'}, "
            f"priv flag {'yes' if self.privflag else 'no'}, senders from {src}")

    # --- state of a window -------------------------------------------------------
    def snapshot(self) -> dict:
        """No process is spawned here (under KASAN + TCG a spawn costs
        seconds): /proc/net/dev, TUNGETIFF, and the root qdisc the kernel
        reported after the last swap (only a qdisc action changes it)."""
        # Link state first, then RTNL, then the counters: linkwatch sets the
        # operstate and activates the qdisc in one RTNL section, so a state
        # read as "up" is an active qdisc once RTNL was free after it, and
        # the counters read after that cannot include the noop qdisc's
        # drops from before the activation. Until 2026-11-26 the counters
        # came first: the likeliest reading of the 49 drops after a
        # flag_reopen in one CI round on series v10 (docs/chaos.md).
        link = tl.link_state(DEV)
        tl.rtnl_barrier(DEV)
        return {"t": time.monotonic() - T0, **link, "tx_dropped": tl.tx_dropped(DEV),
                "drop_sites": self.drop_sites.read(),
                "qdisc_drops": tl.qdisc_drops(DEV),
                "bp": self.kernel_bp(), "qdisc": self.qdisc_kind, "link": self.link_up,
                "attached": sum(1 for s in self.slots if s.tun is not None and s.attached)}

    @staticmethod
    def protected(a: dict) -> bool:
        # Operstate "up": linkwatch sets it, then activates the qdiscs, when
        # the carrier comes on (closing the last queue turns it off, TUNSETIFF
        # on again); until then the noop qdisc drops what is sent and counts
        # it in tx_dropped, for every device.
        return (a["bp"] and a["qdisc"] not in UNQUEUED and a["link"] and a["attached"] > 0
                and a["carrier"] == 1 and a["operstate"] == tl.IF_OPER_UP)

    def account(self, a: dict, b: dict, what: str) -> None:
        """Window a -> b: no action in between, or one of KEEPS_PROTECTION."""
        d = b["tx_dropped"] - a["tx_dropped"]
        same = all(a[k] == b[k] for k in ("bp", "qdisc", "link", "attached",
                                          "carrier", "carrier_changes", "operstate"))
        w = self.windows
        if same and self.protected(a):
            w["protected"] += 1
            w["protected_s"] += b["t"] - a["t"]
            w["protected_drops"] += d
            if d:
                sites = DropSites.delta(a["drop_sites"], b["drop_sites"])
                qd = b["qdisc_drops"] - a["qdisc_drops"]
                w["bad_windows"].append({"after": what, "drops": d,
                                         "drop_sites": sites, "qdisc_drops": qd,
                                         "from": a, "to": b})
                say(f"RING DROPS in a protected window after {what}: {d}, "
                    f"freed at {sites if sites is not None else '(no tracefs hist)'}, "
                    f"root qdisc's own drops {qd} ({a} -> {b})")
        else:
            w["unprotected"] += 1
            w["unprotected_drops"] += d

    # --- actions --------------------------------------------------------------------
    def pick(self, pred=lambda s: True) -> Slot | None:
        c = [s for s in self.slots if s.tun is not None and pred(s)]
        return self.rng.choice(c) if c else None

    def a_pause(self) -> str:
        s = self.pick()
        if s is None:
            return "pause: no queue"
        if s.paused:
            s.rx.go()
        else:
            s.rx.pause()
        s.paused = not s.paused
        return f"{'pause' if s.paused else 'resume'} q{s.idx}"

    def a_reopen(self) -> str:
        s = self.rng.choice(self.slots)
        self.close_slot(s)
        self.open_slot(s)
        return f"reopen q{s.idx}"

    def a_detach(self) -> str:
        s = self.pick()
        if s is None:
            return "detach: no queue"
        s.tun.set_queue(not s.attached)
        s.attached = not s.attached
        return f"{'attach' if s.attached else 'detach'} q{s.idx}"

    def a_backend(self) -> str:
        s = self.pick(lambda s: s.kind == "vhost")
        if s is None:
            return self.a_pause()
        if s.backend:
            s.rx.detach()
        else:
            s.rx.attach()
        s.backend = not s.backend
        return f"vhost backend {'attach' if s.backend else 'detach'} q{s.idx}"

    def a_qlen(self) -> str:
        n = self.rng.choice(QLENS)
        tl.sh(f"ip link set dev {DEV} txqueuelen {n}")
        return f"txqueuelen {n}"

    def a_mtu(self) -> str:
        """The MTU changed under traffic: our tun restarts every queue's
        BQL state from two frames of the new MTU (series v9)."""
        n = self.rng.choice(MTUS)
        tl.sh(f"ip link set dev {DEV} mtu {n}")
        return f"mtu {n}"

    def a_link(self) -> str:
        """Link down, a random 0-1 s with it down (the senders keep trying),
        link up: ndo_stop and ndo_open with traffic in flight."""
        down_s = self.rng.uniform(0.0, 1.0)
        self.set_link(False)
        time.sleep(down_s)
        self.set_link(True)
        return f"link down for {down_s:.2f}s, up ({self.qdisc_kind})"

    def set_link(self, up: bool) -> None:
        tl.sh(f"ip link set dev {DEV} {'up' if up else 'down'}")
        self.link_up = up
        if up:      # link down flushed the route and the neighbour
            tl.sh(f"ip neigh replace {tl.PEER_IP} lladdr {tl.PEER_MAC} dev {DEV} nud permanent")
            # a qdisc deleted while down is replaced by the default at up
            self.qdisc_kind = root_kind()

    def a_qdisc(self) -> str:
        name = self.rng.choices(list(QDISCS), [QDISC_WEIGHT[q] for q in QDISCS])[0]
        spec = QDISCS[name]
        if spec is None:
            tl.sh(f"tc qdisc del dev {DEV} root", check=False)
        elif name == "fq_codel":
            tl.set_fq_codel(DEV)
        else:
            tl.set_qdisc(DEV, spec)
        self.qdisc_kind = root_kind()
        return f"qdisc {name} ({self.qdisc_kind})"

    def a_flag_reopen(self) -> str:
        want = self.bp_supported and self.rng.random() < 0.5
        self.flags = BASE_FLAGS | (tl.IFF_BACKPRESSURE if want else 0)
        for s in self.slots:
            self.close_slot(s)
        for s in self.slots:
            self.open_slot(s)
        return f"reopen all {'with' if want else 'without'} IFF_BACKPRESSURE " \
               f"-> TUNGETIFF says {'on' if self.program_bp() else 'off'}" \
               f"{', operator switch on' if self.admin_on else ''}"

    def toggle_priv_flag(self, flag: str, state_attr: str) -> str:
        """Switch ethtool private flag @flag over (its last state set by this
        run in self.<state_attr>) with traffic in flight; half of the time
        switch it back after 0-1 s. Returns the action's text."""
        on = not getattr(self, state_attr)
        tl.set_priv_flag(DEV, flag, on)
        setattr(self, state_attr, on)
        text = f"ethtool priv flag {flag} {'on' if on else 'off'}"
        if self.rng.random() < 0.5:
            back_s = self.rng.uniform(0.0, 1.0)
            time.sleep(back_s)
            tl.set_priv_flag(DEV, flag, not on)
            setattr(self, state_attr, not on)
            text += f" for {back_s:.2f}s, then {'off' if on else 'on'}"
        return text

    def a_privflag(self) -> str:
        """ethtool priv flag "backpressure" switched over (run-time toggles
        with traffic in flight). Without the flag: a reopen with or without
        IFF_BACKPRESSURE instead."""
        if not self.privflag:
            return self.a_flag_reopen()
        return self.toggle_priv_flag("backpressure", "admin_on")

    def a_bql(self) -> str:
        """ethtool priv flag "bql": byte queue limits off or on with traffic
        in flight. Consumers test it before they consume; switching it on
        waits for those that saw it off, then resets every queue's BQL
        state. Without the flag (no BQL in this tun): a pause instead."""
        if not self.bqlflag:
            return self.a_pause()
        return self.toggle_priv_flag("bql", "bql_on")

    ACTIONS = [("pause", 6), ("reopen", 2), ("detach", 3), ("backend", 2), ("qlen", 2),
               ("link", 1), ("qdisc", 2), ("flag_reopen", 1), ("privflag", 1),
               ("bql", 1), ("mtu", 1)]

    # --- the run --------------------------------------------------------------------
    @classmethod
    def weights(cls, spec: str) -> dict[str, int]:
        """ACTIONS' weights, with those CHAOS_WEIGHTS ("flag_reopen=5,link=0")
        overrides: to aim a round at one transition when reproducing."""
        w = dict(cls.ACTIONS)
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, _, val = item.partition("=")
            if name not in w or not val.isdigit():
                raise ValueError(f"CHAOS_WEIGHTS: {item!r}: want name=int, names {list(w)}")
            w[name] = int(val)
        if not any(w.values()):
            raise ValueError("CHAOS_WEIGHTS: every weight is 0")
        return w

    def run(self, duration: float) -> None:
        spec = os.environ.get("CHAOS_WEIGHTS", "")
        w = self.weights(spec)
        names, weights = list(w), list(w.values())
        say(f"chaos for {duration:.0f}s, seed {self.seed}" + (f", weights {w}" if spec else ""))
        end = time.monotonic() + duration
        prev = self.snapshot()
        last = "start"
        counts: dict[str, int] = {}
        while time.monotonic() < end:
            time.sleep(self.rng.uniform(0.1, 1.0))
            cur = self.snapshot()
            self.account(prev, cur, last)
            name = self.rng.choices(names, weights)[0]
            what = getattr(self, "a_" + name)()
            after = self.snapshot()
            d = after["tx_dropped"] - cur["tx_dropped"]
            if name in KEEPS_PROTECTION:
                # the device stayed protected through the action: it counts
                # as a protected window (drops here fail the check too)
                self.account(cur, after, what)
            elif d:
                td = self.windows["transition_drops"]
                td[name] = td.get(name, 0) + d
            counts[name] = counts.get(name, 0) + 1
            self.events.append({"t": round(after["t"], 2), "action": what,
                                "bp": after["bp"], "qdisc": after["qdisc"]})
            say(f"{what}  (bp {'on' if after['bp'] else 'off'}, qdisc {after['qdisc']}, "
                f"tx_dropped {after['tx_dropped']}"
                + ("" if after["operstate"] == tl.IF_OPER_UP else
                   f", operstate {after['operstate']} carrier {after['carrier']}") + ")")
            prev, last = after, what
        self.account(prev, self.snapshot(), last)
        self.result["actions"] = counts
        self.result["windows"] = self.windows
        # every drop of the round (all devices) by function and reason
        self.result["drop_sites"] = self.drop_sites.read()
        say(f"drops by site: {self.result['drop_sites'] if self.drop_sites.ok else 'no tracefs hist in this kernel'}")
        say(f"actions {sum(counts.values())} {counts}")
        say(f"windows: {self.windows['protected']} protected "
            f"({self.windows['protected_s']:.0f}s, {self.windows['protected_drops']} drops), "
            f"{self.windows['unprotected']} unprotected "
            f"({self.windows['unprotected_drops']} drops)")

    def settle(self) -> None:
        """Stop the senders, undo every disturbance, drain, send a fresh burst."""
        for snd in self.senders:
            r = snd.stop()
            say(f"sender {snd.label}: {r}")
        self.senders = []
        if not self.link_up:
            self.set_link(True)
        for s in self.slots:
            if s.tun is None:
                self.open_slot(s)
            if not s.attached:
                s.tun.set_queue(True)
                s.attached = True
            if s.kind == "vhost" and not s.backend:
                s.rx.attach()
                s.backend = True
            if s.paused:
                s.rx.go()
                s.paused = False
        tl.sh(f"ip link set dev {DEV} txqueuelen 500")
        tl.set_fq_codel(DEV)
        self.qdisc_kind = "fq_codel"
        t = time.monotonic()
        stall = None
        try:
            tl.wait_backlog_zero(DEV, stall_s=STALL_S)
            self.quiesce()
        except AssertionError as e:
            stall = str(e)
        self.result["drain"] = {"ok": stall is None, "seconds": round(time.monotonic() - t, 1),
                                "error": stall}
        say(f"drain: {'ok' if stall is None else stall} in {time.monotonic() - t:.1f}s")
        if stall:
            self.result["burst"] = {"ok": False, "error": "not sent: the device did not drain"}
            return
        base = self.delivered(BURST_ID)
        r = self.env.burst(BURST, size=600, ident=BURST_ID, sport=22000, flows=16,
                           sndbuf=SNDBUF)
        got, t = base, time.monotonic()
        last_change = t
        while got - base < BURST and time.monotonic() - last_change < STALL_S:
            time.sleep(0.3)
            n = self.delivered(BURST_ID)
            if n != got:
                got, last_change = n, time.monotonic()
        got -= base
        ok = got == BURST and r.get("sent", BURST) == BURST
        self.result["burst"] = {"ok": ok, "sent": r.get("sent"), "delivered": got,
                                "tx_dropped": tl.tx_dropped(DEV)}
        say(f"fresh burst: {got}/{BURST} delivered (sender {r})")

    def quiesce(self, quiet_s: float = 1.5) -> None:
        prev, since = None, time.monotonic()
        while True:
            cur = [s.rx.stat().get("pkts") for s in self.slots]
            if cur != prev:
                prev, since = cur, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            if time.monotonic() - since > STALL_S:
                raise AssertionError(f"STALL: consumers still busy after {STALL_S}s")
            time.sleep(0.3)

    def delivered(self, ident: int) -> int:
        n = 0
        for s in self.slots:
            per = s.rx.stat().get("per_id", []) if s.rx else []
            n += (per[ident] if ident < len(per) else 0) + s.delivered.get(ident, 0)
        return n

    def teardown(self) -> None:
        for s in self.slots:
            self.close_slot(s)
        self.env.cleanup()
        self.env.persistent.clear()


def root_kind() -> str:
    """The root qdisc's kind; when tc lists no root (seen right after
    `tc qdisc del root` with queues detached), the first listed kind, or
    "none"; logged, and never counted as a queueing qdisc."""
    qs = tl.qdiscs(DEV)
    for q in qs:
        if q.get("root"):
            return q.get("kind", "none")
    say(f"no root qdisc listed on {DEV}: {qs}")
    return "none"


# --- kernel log and kmemleak ---------------------------------------------------------
def kernel_log() -> list[str]:
    r = subprocess.run(["dmesg"], capture_output=True, text=True)
    return r.stdout.splitlines()


def splats(lines: list[str]) -> list[dict]:
    """Each report: its first line and up to 80 following lines (until the
    next report or an end marker), and whether it involves our code."""
    out = []
    i = 0
    while i < len(lines):
        if SPLAT_RE.search(lines[i]):
            block = [lines[i]]
            j = i + 1
            while j < len(lines) and len(block) < 80 and not SPLAT_RE.search(lines[j]):
                block.append(lines[j])
                if "end trace" in lines[j] or "==================" in lines[j]:
                    j += 1
                    break
                j += 1
            text = "\n".join(block)
            out.append({"first": lines[i].strip(), "ours": involves_ours(block),
                        "text": text})
            i = j
        else:
            i += 1
    return out


KCSAN_ACCESS_RE = re.compile(r"(read|write).* of \d+ bytes by (task|interrupt)")


def involves_ours(block: list[str]) -> bool:
    """A KCSAN report is ours when an unmarked access of the two racing ones
    is made by a function of ours (the first frame under its "read/write
    ... by task" line): the unmarked access is the one that needs marking.
    An access KCSAN labels "(marked)" in a function of ours is a core
    helper's atomic inlined there (netif_tx_wake_queue()'s
    test_and_clear_bit()); racing with a plain read in the core, the report
    is listed as other, as when the helper is not inlined. Every other
    report is ours when tun, tap, vhost or ptr_ring appears anywhere in it."""
    if "BUG: KCSAN" not in block[0]:
        return bool(OURS_RE.search("\n".join(block)))
    acc = [(ln, block[k + 1]) for k, ln in enumerate(block[:-1]) if KCSAN_ACCESS_RE.search(ln)]
    plain = [f for ln, f in acc if "(marked)" not in ln] or [f for _, f in acc]
    return any(OURS_RE.search(f) for f in plain)


def have_kmemleak() -> bool:
    """kmemleak's debugfs file, mounting debugfs first if needed."""
    if not os.path.exists(KMEMLEAK):
        subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"],
                       capture_output=True)
    return os.path.exists(KMEMLEAK)


def kmemleak_scan() -> dict:
    if not have_kmemleak():
        return {"available": False}
    # an object must stay unreferenced for 5 s (kmemleak min age) and be
    # seen by a scan; two scans make the report stable
    time.sleep(6)
    for _ in range(2):
        tl.write_file(KMEMLEAK, "scan")
    text = Path(KMEMLEAK).read_text(errors="replace")
    objs = [o for o in re.split(r"(?=^unreferenced object)", text, flags=re.M) if o.strip()]
    ours = [o for o in objs if OURS_RE.search(o)]
    return {"available": True, "leaks": len(objs), "ours": len(ours), "text": text}


def kmemleak_clear() -> None:
    if have_kmemleak():
        try:
            tl.write_file(KMEMLEAK, "clear")
        except OSError as e:
            say(f"kmemleak clear: {e}")


# --- entry points ------------------------------------------------------------------------
def run(duration: float, seed: int, tools: str, out: Path | None) -> dict:
    """The whole chaos round; returns the result dict (also chaos.json in out)."""
    say(f"seed {seed} (reproduce: make chaos SEED={seed} DURATION={int(duration)})")
    kmemleak_clear()
    orig = os.open("/proc/self/ns/net", os.O_RDONLY)
    tl.unshare_net()
    c = Chaos(tools, seed)
    res = c.result
    res.update(duration_s=duration, kernel=os.uname().release,
               features=hex(tl.get_features()), bp_supported=c.bp_supported,
               vhost=c.vhost)
    try:
        tl.sh("ip link set dev lo up")
        tl.sh("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1",
              check=False)
        c.setup()
        res["privflag"] = c.privflag
        c.run(duration)
        c.settle()
    except Exception as e:  # noqa: BLE001 - recorded as the run's error
        import traceback
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        try:
            c.teardown()
        finally:
            tl.setns(orig)
            os.close(orig)
    res["events"] = c.events
    leaks = kmemleak_scan()
    klog = kernel_log()
    sp = splats(klog)
    noq = sum(1 for ln in klog if NOQUEUE_MSG in ln)
    res["kmemleak"] = {k: v for k, v in leaks.items() if k != "text"}
    res["splats"] = {"ours": [s["first"] for s in sp if s["ours"]],
                     "other": [s["first"] for s in sp if not s["ours"]],
                     "noqueue_messages": noq}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "chaos.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "chaos-dmesg.log").write_text("\n".join(klog) + "\n")
        if sp:
            (out / "chaos-splats.log").write_text("\n\n".join(s["text"] for s in sp) + "\n")
        if leaks.get("text"):
            (out / "chaos-kmemleak.log").write_text(leaks["text"])
    say(f"splats: {len(res['splats']['ours'])} ours, {len(res['splats']['other'])} other; "
        f"kmemleak: {res['kmemleak']}; '{NOQUEUE_MSG}' x{noq}")
    return res


def verdict(res: dict) -> list[str]:
    """The failed checks (empty: clean)."""
    bad = []
    if res.get("error"):
        bad.append(f"error: {res['error']}")
    w = res.get("windows", {})
    if w.get("protected_drops"):
        bad.append(f"ring_drops: {w['protected_drops']} in protected windows")
    if not res.get("drain", {}).get("ok"):
        bad.append(f"drain: {res.get('drain')}")
    if not res.get("burst", {}).get("ok"):
        bad.append(f"burst: {res.get('burst')}")
    if res.get("splats", {}).get("ours"):
        bad.append(f"splats: {res['splats']['ours']}")
    if res.get("kmemleak", {}).get("ours"):
        bad.append(f"kmemleak: {res['kmemleak']['ours']} leaks involving tun/vhost/ptr_ring")
    return bad


def env_defaults() -> dict:
    """DURATION (s, default 120), SEED (default random), NODROP_TOOLS,
    NODROP_RESULTS: what the lab passes; shared by main() and test_chaos.py."""
    env = os.environ
    return {"duration": float(env.get("DURATION") or 120),
            "seed": int(env.get("SEED") or int.from_bytes(os.urandom(4), "little")),
            "tools": env.get("NODROP_TOOLS", str(HERE.parent.parent / "tools" / "build")),
            "results": env.get("NODROP_RESULTS")}


def main() -> int:
    d = env_defaults()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=d["duration"])
    ap.add_argument("--seed", type=int, default=d["seed"])
    ap.add_argument("--tools", default=d["tools"])
    ap.add_argument("--results", default=d["results"])
    a = ap.parse_args()
    res = run(a.duration, a.seed, a.tools, Path(a.results) if a.results else None)
    bad = verdict(res)
    say(("CLEAN" if not bad else "FAILED: " + "; ".join(bad)) + f" (seed {a.seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
