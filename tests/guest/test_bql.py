"""Byte queue limits under backpressure (the series' patch "size the ring's
backlog with byte queue limits" and those after it, 6.12 and 7.3).

With backpressure tun accounts the bytes its rings hold per TX queue (BQL),
so the queue stops at the BQL limit (the core's STACK_XOFF) long before the
ring's own stop level (txqueuelen packets), and the backlog waits in the
qdisc. The limit and the bytes in flight are in
/sys/class/net/<dev>/queues/tx-<n>/byte_queue_limits/ ("net-sysfs: show
byte_queue_limits of lockless Tx devices that keep BQL"; a DKMS
build on Debian's kernel has BQL but not that directory).

Feature detection: IFF_BACKPRESSURE in TUNGETFEATURES (else skip); the
sysfs checks only where the directory exists.

test_bql_ring_holds_limit: 200 x 1000 B into a paused reader, fq_codel,
    default txqueuelen (tun 500, tap 1000): the ring takes what BQL allows
    (a fresh limit lets one packet in), the qdisc holds the rest; the bytes
    in flight are those of the ring; once the reader resumes, all 200
    arrive, no drop, and nothing is in flight. Without BQL the ring takes
    all 200 (the stop level is 500) and the qdisc holds nothing.
test_bql_switch_off: "ours without BQL", as the bench measures it: after
    200 datagrams with BQL on, tun's "bql" ethtool private flag off, then
    a burst at txqueuelen 25: the ring takes 25 (its stop level), fq_codel
    holds 175, nothing is accounted, and the qdisc hands packets over one at
    a time (at most one requeue). Without "lib: dynamic_queue_limits: reset
    adj_limit in dql_reset()" the reset keeps DQL's stale adj_limit (the
    bytes completed before) as the qdisc's bulk dequeue budget: ~175
    packets go to the requeue slot at once. Switched on again under that
    backlog, all 200 arrive.
test_bql_lifecycle: a paused reader with bytes in flight, then one
    lifecycle path (queue detach + attach, txqueuelen change, link down/up,
    the operator switch off, the operator switch on over a ring filled
    without backpressure); then the reader resumes: no stall (a fresh burst
    arrives complete, no ring drop), and nothing in flight at the end.
    Without the resets the queue stays stopped (detach purges accounted
    packets); without the in-flight bound of completions, the flag-on path
    BUG()s in dql_completed().
test_bql_vhost_giveback: vhost-net gives back a batch it took (backend
    detached): the entries it completed are in the ring again, and what is
    in flight never exceeds what the ring holds; all arrive, nothing stays
    in flight.
test_bql_noqueue_giveback: with a noqueue root, vhost-net's give-back
    accounts nothing, and the datagrams sent after it all reach the ring
    (6.12 v11 and the 7.3 series before its net-next 4/5 fix: the give-back
    accounted them, BQL stopped the queue and the core dropped them).

After every drain (the ring empty) nothing is in flight.
"""

from __future__ import annotations

import os
import time

import pytest

from test_lifecycle import quiesce
from test_vhost import VHOST_DEV
from tunlib import (IFF_MULTI_QUEUE, IFF_NO_PI, IFF_TAP, IFF_TUN, bql, has_priv_flag, lacks,
                    log, qdisc_totals, qsummary, root_qdisc, set_fq_codel, set_priv_flag,
                    set_qdisc, setup_ip, sh, tx_dropped, wait_backlog_zero, wait_for,
                    wait_ring, wait_tx_settled)

N = 200            # datagrams per burst
SIZE = 1000        # UDP payload bytes
SNDBUF = 16 << 20
FRESH = 100
RING = 25          # txqueuelen where the ring's stop level is under test
IP_UDP = 28        # IPv4 + UDP headers: bytes of one datagram on a tun
ETH = 14


@pytest.fixture(autouse=True)
def _needs_bp(env):
    if not env.bp:
        lacks("backpressure", "no IFF_BACKPRESSURE in TUNGETFEATURES: no BQL either")


def wire_bytes(tap: bool) -> int:
    return SIZE + IP_UDP + (ETH if tap else 0)


def assert_drained(b: dict | None) -> None:
    """The ring is empty: nothing is in flight."""
    if b is not None:
        assert b["inflight"] == 0, f"bytes in flight with an empty ring: {b}"


def paused_burst(env, kind: str, flags: int = 0, txqueuelen: int | None = None):
    """A device with fq_codel and a paused reader; N datagrams sent.
    Returns (tun, reader, packets in the ring)."""
    tap = kind == "tap"
    t = env.tun("ndbql0", (IFF_TAP if tap else IFF_TUN) | IFF_NO_PI | flags)
    setup_ip(t.name, tap=tap, txqueuelen=txqueuelen)
    set_fq_codel(t.name)
    reader = env.reader(t, tap=tap, paused=True)
    r = env.burst(N, size=SIZE, ident=1, sndbuf=SNDBUF)
    assert r["ok"] == N, r
    q = wait_tx_settled(t.name)
    in_ring = N - q["qlen"] - tx_dropped(t.name)
    log(f"{kind}: qdisc {qsummary(root_qdisc(t.name))}, in the ring {in_ring}, "
        f"bql {bql(t.name)}")
    return t, reader, in_ring


def drain(env, t, reader, expect: int) -> None:
    """Resume the reader: it gets `expect` of ident 1, nothing is dropped,
    the qdisc empties, a fresh burst arrives complete, nothing in flight."""
    reader.go()
    r = reader.wait("id1", expect, stall_s=60)
    assert r["result"] == "ok", (f"STALL: reader got {r['per_id'][1]} of {expect}; "
                                 f"qdisc {qsummary(root_qdisc(t.name))} bql {bql(t.name)}")
    quiesce([reader], t.name)
    d0 = tx_dropped(t.name)
    base = reader.stat()["per_id"][2]
    r = env.burst(FRESH, size=SIZE, ident=2, sndbuf=SNDBUF)
    assert r["ok"] == FRESH, r
    r = reader.wait("id2", base + FRESH, stall_s=60)
    assert r["result"] == "ok", (f"STALL: fresh burst {r['per_id'][2] - base}/{FRESH}; "
                                 f"qdisc {qsummary(root_qdisc(t.name))} bql {bql(t.name)}")
    quiesce([reader], t.name)
    assert tx_dropped(t.name) == d0, "ring drops during the fresh burst"
    assert_drained(bql(t.name))


@pytest.mark.parametrize("kind", ["tun", "tap"])
def test_bql_ring_holds_limit(env, kind, record_property):
    t, reader, in_ring = paused_burst(env, kind, env.bp_flag())
    b = bql(t.name)
    record_property("in_ring", in_ring)
    record_property("bql", str(b))
    assert tx_dropped(t.name) == 0
    if not has_priv_flag(t.name, "bql"):
        # backpressure without BQL (mainline, our 7.3 series): the ring is
        # the standing queue fq_codel cannot see; record it, check the rest
        drain(env, t, reader, N)
        lacks("bql", f"no BQL in this tun (no 'bql' private flag): "
                     f"the ring took {in_ring} of {N}, fq_codel held {N - in_ring}",
              xfail=True)
    # the stop level is txqueuelen (500/1000): only BQL stops the queue this early
    assert in_ring < N // 2, f"the ring took {in_ring} of {N}: no byte queue limit"
    if b is not None:
        assert b["inflight"] == in_ring * wire_bytes(kind == "tap"), b
        assert b["inflight"] <= b["limit"] + wire_bytes(kind == "tap"), b
    else:
        log("NOTICE: no byte_queue_limits in sysfs (kernel without the net-sysfs patch)")
    drain(env, t, reader, N)


def test_bql_switch_off(env, record_property):
    """What the bench calls "ours without BQL": the "bql" private flag off,
    after traffic with BQL on (DQL has completed bytes) and under a backlog
    BQL left in the qdisc: the switch resets BQL and runs the qdisc."""
    t = env.tun("ndbql0", IFF_TUN | IFF_NO_PI | env.bp_flag())
    if not has_priv_flag(t.name, "bql"):
        lacks("bql", "no 'bql' ethtool private flag (no BQL in this tun)")
    setup_ip(t.name, tap=False, txqueuelen=RING)
    set_fq_codel(t.name)
    reader = env.reader(t)
    r = env.burst(N, size=SIZE, ident=3, sndbuf=SNDBUF)
    assert r["ok"] == N, r
    assert reader.wait("id3", N, stall_s=60)["result"] == "ok"
    quiesce([reader], t.name)
    reader.pause()
    r = env.burst(N, size=SIZE, ident=1, sndbuf=SNDBUF)
    assert r["ok"] == N, r
    held = N - wait_tx_settled(t.name)["qlen"]
    q0 = root_qdisc(t.name)
    set_priv_flag(t.name, "bql", False)
    wait_tx_settled(t.name)
    q = root_qdisc(t.name)
    b = bql(t.name)
    requeues = q["requeues"] - q0["requeues"]
    summary = (f"bql on: the ring held {held}; bql off: qdisc {qsummary(q)} "
               f"requeues +{requeues} bql {b}")
    log(summary)
    record_property("requeues", requeues)
    assert held < RING, f"BQL did not keep the backlog in the qdisc: {summary}"
    assert tx_dropped(t.name) == 0, summary
    assert q["qlen"] == N - RING, f"the ring did not stop at txqueuelen; {summary}"
    if b is not None:
        # a kernel with the series' core patches (the byte_queue_limits
        # directory and dql_reset()'s fix): the qdisc hands packets over one
        # by one, as without BQL (the bulk dequeue budget is DQL's, not what
        # was completed before the switch); a tun module for a stock kernel
        # keeps dql_reset()'s stale budget until the next completion
        assert requeues <= 1, f"bulk dequeue into the requeue slot; {summary}"
        assert b["inflight"] == 0, f"accounted with BQL off: {summary}"
    set_priv_flag(t.name, "bql", True)
    drain(env, t, reader, N)


def _detach_attach(env, t, ctx):
    t.set_queue(False)       # purges the ring: its bytes are never completed
    # paces: the queue stays detached for a moment (what the qdisc hands it
    # meanwhile is dropped); decides no verdict: the reader gets what is left
    time.sleep(0.3)
    t.set_queue(True)


def _resize(env, t, ctx):
    sh(f"ip link set dev {t.name} txqueuelen 600")


def _down_up(env, t, ctx):
    sh(f"ip link set dev {t.name} down")
    sh(f"ip link set dev {t.name} up")
    set_fq_codel(t.name)


def _flag_off(env, t, ctx):
    set_priv_flag(t.name, "backpressure", False)


def _flag_on(env, t, ctx):
    set_priv_flag(t.name, "backpressure", True)


# path -> (device flags, operator switch before the burst, what the reader gets)
PATHS = {
    "detach_attach": (IFF_MULTI_QUEUE, None, _detach_attach, "fresh"),
    # a txqueuelen change deactivates the device's qdiscs, which resets them
    # (dev_qdisc_change_tx_queue_len(): the core drops their backlog on every
    # device): only the ring's packets and the fresh burst arrive
    "resize": (0, None, _resize, "fresh"),
    "down_up": (0, None, _down_up, "fresh"),
    "flag_off": (0, True, _flag_off, "all"),
    "flag_on_over_unaccounted": (0, False, _flag_on, "all"),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_bql_lifecycle(env, path, record_property):
    extra, switch, action, gets = PATHS[path]
    bp = env.bp_flag() if switch is None else 0
    t = env.tun("ndbql0", IFF_TUN | IFF_NO_PI | extra | bp)
    if switch is not None:
        if not has_priv_flag(t.name, "backpressure"):
            lacks("switch", "no 'backpressure' ethtool private flag")
        set_priv_flag(t.name, "backpressure", switch)
    setup_ip(t.name, tap=False)
    set_fq_codel(t.name)
    reader = env.reader(t, paused=True)
    r = env.burst(N, size=SIZE, ident=1, sndbuf=SNDBUF)
    assert r["ok"] == N, r
    wait_tx_settled(t.name)
    before = bql(t.name)
    log(f"{path}: before: qdisc {qsummary(root_qdisc(t.name))} bql {before}")
    action(env, t, None)
    wait_tx_settled(t.name)
    log(f"{path}: after: qdisc {qsummary(root_qdisc(t.name))} bql {bql(t.name)} "
        f"tx_dropped={tx_dropped(t.name)}")
    if gets == "all":
        drain(env, t, reader, N)
    else:
        # packets of the purged ring / of the reset qdisc are gone: only
        # the fresh burst counts
        reader.go()
        quiesce([reader], t.name)
        drain(env, t, reader, reader.stat()["per_id"][1])


def giveback_tap(env, name: str):
    """A tap with backpressure for the vhost-net give-back tests; skips
    without /dev/vhost-net."""
    if not os.path.exists(VHOST_DEV):
        lacks("vhost-net", f"no {VHOST_DEV}")
    return env.tun(name, IFF_TAP | IFF_NO_PI | env.bp_flag())


def held_by_vhost(env, t, ident: int, n: int, txqueuelen: int | None = None):
    """fq_codel on t, vhost-net attached with no buffer posted: it runs once
    at the first packet and takes what the ring holds into its private
    buffer, where it stays; n datagrams sent and settled. Returns the
    VhostRx."""
    setup_ip(t.name, tap=True, txqueuelen=txqueuelen)
    set_fq_codel(t.name)
    rx = env.vhostrx(t, paused=True)
    r = env.burst(n, size=SIZE, ident=ident, sndbuf=SNDBUF)
    assert r["ok"] == n, r
    # vhost-net took its batch (BQL completed it: fewer bytes in flight
    # than tun was handed), and the split is final: the qdisc is empty or
    # BQL stopped the queue. Needs byte_queue_limits in sysfs.
    wire = wire_bytes(True)

    def state():
        q, b = qdisc_totals(t.name), bql(t.name)
        handed = n - q["qlen"] - tx_dropped(t.name)  # qlen counts a requeued packet
        return (q["qlen"], handed, b["inflight"], b["limit"])

    wait_for(f"vhost-net's batch of ident {ident} and the split after it", state,
             lambda st: st[1] * wire > st[2] and (st[0] == 0 or st[2] > st[3]))
    return rx


def deliver_after_giveback(t, rx, expected: dict[str, int], summary: str) -> None:
    """Re-attach vhost-net after a give-back and let it run: every datagram
    (count per ident) arrives, the backlog drains, nothing was dropped."""
    rx.attach()
    rx.go()
    for ident, n in expected.items():
        r = rx.wait(ident, n, stall_s=60)
        assert r["result"] == "ok", f"STALL after the give-back ({ident}); {summary}"
    wait_backlog_zero(t.name)
    assert tx_dropped(t.name) == 0, summary


def test_bql_vhost_giveback(env, record_property):
    """vhost-net holds a batch it took (completed for BQL) when its backend
    is detached: the entries it gives back are in the ring again, completed
    already, and are not completed again when taken again: what is in
    flight never exceeds what the ring holds."""
    t = giveback_tap(env, "ndbqlv0")
    if bql(t.name) is None:
        lacks("bql-sysfs", "no byte_queue_limits in sysfs (kernel without the net-sysfs patch)")
    rx = held_by_vhost(env, t, 5, 60)
    held = bql(t.name)
    rx.detach()              # gives the batch back within the ioctl
    q = wait_tx_settled(t.name)
    got = rx.stat()["pkts"]
    # what is neither in the qdisc (its backlog counts a requeued packet,
    # which its sent counter counts too) nor delivered nor dropped
    in_ring = 60 - q["qlen"] - got - tx_dropped(t.name)
    b = bql(t.name)
    summary = (f"before detach bql {held}; after: qdisc {qsummary(root_qdisc(t.name))}, "
               f"consumer got {got}, in the ring {in_ring}, bql {b}")
    log(summary)
    record_property("bql_after_giveback", str(b))
    assert in_ring * wire_bytes(True) > held["inflight"], f"vhost gave nothing back; {summary}"
    assert b["inflight"] <= in_ring * wire_bytes(True), summary
    deliver_after_giveback(t, rx, {"id5": 60}, summary)
    quiesce([rx], t.name)
    assert_drained(bql(t.name))


NOQUEUE_HELD = 10  # datagrams vhost-net holds: 10 x 1042 B, over a fresh limit
NOQUEUE_MORE = 5   # datagrams sent after the give-back


def test_bql_noqueue_giveback(env, record_property):
    """With a noqueue root nothing is accounted for BQL: the core drops the
    skbs of a queue it finds stopped ("Virtual device ... asks to queue
    packet!"), so producers leave BQL alone there. vhost-net's give-back
    must too: the entries it puts back were never accounted, and
    accounting them (over a fresh limit) set
    STACK_XOFF, so that every datagram sent while vhost-net was paused was
    dropped although the ring had room."""
    t = giveback_tap(env, "ndbqlv2")
    if not has_priv_flag(t.name, "bql"):
        lacks("bql", "no 'bql' ethtool private flag (no BQL in this tun)")
    setup_ip(t.name, tap=True)
    set_qdisc(t.name, "noqueue")
    assert root_qdisc(t.name)["kind"] == "noqueue"
    # the burst waits in the ring; vhost-net, attached after it, runs at
    # once (the socket is readable), takes the whole ring into its buffer
    # and keeps it there: no guest buffer is posted
    r = env.burst(NOQUEUE_HELD, size=SIZE, ident=9, sndbuf=SNDBUF)
    assert r["ok"] == NOQUEUE_HELD, r
    rx = env.vhostrx(t, paused=True)
    wait_ring(t, True, "vhost-net takes the ring into its buffer")
    rx.detach()                         # gives the held entries back
    wait_ring(t, False, "vhost-net's give-back at detach")
    b = bql(t.name)
    # noqueue: each datagram reaches tun_net_xmit() (ring or drop) within
    # its own sendto(); nothing is left to wait for once the sender is done
    r = env.burst(NOQUEUE_MORE, size=SIZE, ident=10, sndbuf=SNDBUF)
    drops = tx_dropped(t.name)
    summary = (f"noqueue: bql after the give-back {b}; {r['ok']} of {NOQUEUE_MORE} "
               f"sent after it, tx_dropped {drops}")
    log(summary)
    record_property("bql_noqueue_giveback", summary)
    if b is not None:
        assert b["inflight"] == 0, f"the give-back accounted bytes without a qdisc: {summary}"
    assert r["ok"] == NOQUEUE_MORE and drops == 0, summary
    deliver_after_giveback(t, rx, {"id9": NOQUEUE_HELD, "id10": NOQUEUE_MORE}, summary)
