"""Burst into a paused reader: where do the packets end up?

test_burst_taildrop (brief tests 1 and 8): 1000 UDP datagrams of 1000 bytes
into a device whose ring holds 25 (txqueuelen 25), fq_codel root, reader
attached but paused. Parametrised over TUN/TAP, with and without a virtio-net
header.
  stock kernel: the ring keeps 25, the driver drops 975 (tx_dropped +975),
                the qdisc passed everything through (sent 1000, backlog 0p).
  backpressure: the driver stops the queue when its ring is full: 0 driver
                drops, the qdisc holds the 975 others; once the reader
                resumes it receives all 1000 and the backlog drains to 0.

test_noqueue_legacy (brief test 2): the same burst with a `noqueue` root and
IFF_BACKPRESSURE requested: there is nowhere to hold packets, so every kernel
must keep the legacy tail-drop (975 dropped), never stop the queue.
"""

from __future__ import annotations

import pytest

from tunlib import (IFF_NO_PI, IFF_TAP, IFF_TUN, IFF_VNET_HDR, drained, log, qsummary,
                    ring_level_only, root_qdisc, set_fq_codel, set_qdisc, setup_ip,
                    tx_dropped)

RING = 25          # txqueuelen == ptr_ring size per queue
N = 1000           # datagrams in the burst
SIZE = 1000        # UDP payload bytes
SNDBUF = 16 << 20  # the socket must not block while the qdisc holds ~1 MB

MODES = [
    pytest.param("tun", 0, id="tun"),
    pytest.param("tun", 10, id="tun-vnet10"),
    pytest.param("tap", 0, id="tap"),
    pytest.param("tap", 12, id="tap-vnet12"),
]


def make_device(env, kind: str, vnet: int, extra: int):
    flags = (IFF_TUN if kind == "tun" else IFF_TAP) | IFF_NO_PI | extra
    if vnet:
        flags |= IFF_VNET_HDR
    t = env.tun("ndburst0", flags, vnet_hdr_sz=vnet or None)
    if vnet:
        assert t.vnet_hdr_sz() == vnet
    ring_level_only(t.name)   # the ring's stop level, not BQL (test_bql.py)
    setup_ip(t.name, tap=(kind == "tap"), txqueuelen=RING)
    return t


def drain_and_check(env, dev: str, reader, expect: int) -> dict:
    """Resume the reader; it must get exactly `expect` of our datagrams,
    and the qdisc must end empty."""
    reader.go()
    r = reader.wait("ours", expect, stall_s=60)
    log(f"reader after resume: result={r['result']} ours={r['ours']} "
        f"pkts={r['pkts']} other={r['other']} bad={r['bad']}")
    assert r["result"] == "ok", (
        f"STALL: reader got ours={r['ours']} of expected {expect} and then "
        f"nothing for 60s; qdisc {qsummary(root_qdisc(dev))} "
        f"tx_dropped={tx_dropped(dev)}")
    q = drained(dev, [reader])   # anything beyond `expect` would be a counting bug
    r = reader.stat()
    log(f"final: reader ours={r['ours']} pkts={r['pkts']} bad={r['bad']} "
        f"other={r['other']} qdisc backlog={q['qlen']}p")
    assert r["ours"] == expect, f"reader ours={r['ours']} expected={expect}"
    assert r["bad"] == 0, f"reader saw {r['bad']} malformed packets (header parsing)"
    assert r["other"] == 0, f"reader saw {r['other']} packets that are not ours"
    return r


@pytest.mark.parametrize("kind,vnet", MODES)
def test_burst_taildrop(env, kind, vnet, record_property):
    t = make_device(env, kind, vnet, env.bp_flag())
    qspec = set_fq_codel(t.name)
    reader = env.reader(t, tap=(kind == "tap"), vnet=vnet, paused=True)
    d0 = tx_dropped(t.name)
    q0 = root_qdisc(t.name)

    s = env.burst(N, size=SIZE, ident=1, sndbuf=SNDBUF)
    assert s["ok"] == N, f"sender: {s}"

    drops = tx_dropped(t.name) - d0
    q = root_qdisc(t.name)
    sent = q["packets"] - q0["packets"]
    qdrops = q["drops"] - q0["drops"]
    summary = (f"[{kind} vnet={vnet} bp={env.bp} qdisc='{qspec}'] "
               f"tx_dropped={drops} backlog={q['qlen']}p qdisc_sent={sent} "
               f"qdisc_drops={qdrops} requeues={q['requeues']}")
    log(summary)
    record_property("tx_dropped", drops)
    record_property("backlog", q["qlen"])

    if env.bp:
        assert drops == 0, f"backpressure: expected 0 ring drops; {summary}"
        assert qdrops == 0, f"qdisc dropped; {summary}"
        assert q["qlen"] == N - RING, \
            f"backpressure: expected backlog={N - RING}p in the qdisc; {summary}"
        expect = N
    else:
        # ring size == txqueuelen: the ring keeps exactly RING, the driver
        # tail-drops the rest, the qdisc never holds anything.
        assert drops == N - RING, f"stock: expected tx_dropped={N - RING}; {summary}"
        assert q["qlen"] == 0, f"stock: expected backlog=0p; {summary}"
        assert sent == N, f"stock: qdisc should have passed all {N}; {summary}"
        expect = RING

    drain_and_check(env, t.name, reader, expect)
    assert tx_dropped(t.name) - d0 == drops, "drops while draining"


def test_noqueue_legacy(env, record_property):
    t = make_device(env, "tun", 0, env.bp_flag())
    set_qdisc(t.name, "noqueue")
    assert root_qdisc(t.name)["kind"] == "noqueue"
    reader = env.reader(t, paused=True)
    d0 = tx_dropped(t.name)

    s = env.burst(N, size=SIZE, ident=1, sndbuf=SNDBUF)
    # a tail drop under noqueue may surface as a send error on some kernels;
    # every datagram must have been attempted
    assert s["sent"] == N, f"sender: {s}"

    drops = tx_dropped(t.name) - d0
    summary = (f"[noqueue bp={env.bp}] tx_dropped={drops} (so the ring kept "
               f"{N - drops}, txqueuelen={RING}) send_errors={s['errors']}")
    log(summary)
    record_property("tx_dropped", drops)
    assert drops == N - RING, f"expected legacy tail-drop tx_dropped={N - RING}; {summary}"
    drain_and_check(env, t.name, reader, RING)
