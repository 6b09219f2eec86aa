"""Per-queue flow control on a multi-queue tun (brief test 6).

IFF_MULTI_QUEUE tun with 2 queues, `mq` root with an fq_codel child per
queue. Flow steering without BPF or tc filters: with no steering program and
no flow-table entry (entries are only created by packets *written* to the
device, which we never do), tun picks the tx queue as
reciprocal_scale(symmetric flow hash, numqueues). The hash is fixed for a
boot, so we probe: send one datagram per source port and see which queue's
fd it comes out of, until we have one port for each queue.

Then, with the rings made fresh and small (txqueuelen 32, resize after the
probe), queue 0's reader is paused and flow A (-> queue 0) sends 500:
  backpressure: queue 0 stops; its fq_codel child holds 500-32=468, no ring
                drop; flow B (-> queue 1) is still delivered in full; after
                resuming reader 0 it gets all 500.
  stock:        queue 0's ring keeps 32, 468 tail-dropped; flow B delivered.
"""

from __future__ import annotations

import select
import time

from tunlib import (IFF_MULTI_QUEUE, IFF_NO_PI, IFF_TUN, PEER_IP, UDP_PORT,
                    log, probe_payload, qdisc_by_parent, qsummary,
                    read_all_nonblocking, set_fq_codel, setup_ip, sh,
                    tx_dropped, udp_socket_from, wait_backlog_zero)

RING = 32
N = 500
SNDBUF = 16 << 20
PROBE_PORTS = range(42000, 42064)


def _probe(q0, q1) -> dict[int, int]:
    """Map queue index -> a source port whose flow lands on that queue."""
    found: dict[int, int] = {}
    for i, sport in enumerate(PROBE_PORTS):
        s = udp_socket_from(sport)
        s.sendto(probe_payload(15, i), (PEER_IP, UDP_PORT))
        s.close()
        where = None
        deadline = time.monotonic() + 30
        while where is None and time.monotonic() < deadline:
            select.select([q0.fd, q1.fd], [], [], 1.0)
            for qi, q in ((0, q0), (1, q1)):
                if read_all_nonblocking(q.fd):
                    where = qi
        assert where is not None, f"probe from port {sport} never arrived"
        found.setdefault(where, sport)
        if len(found) == 2:
            break
    log(f"flow probe: queue->source port {found}")
    assert len(found) == 2, f"64 flows all hashed to one queue? {found}"
    return found


def test_multiqueue(env, record_property):
    flags = IFF_TUN | IFF_NO_PI | IFF_MULTI_QUEUE | env.bp_flag()
    q0 = env.tun("ndmq0", flags)
    q1 = env.tun("ndmq0", flags)
    dev = q0.name
    setup_ip(dev, tap=False)
    q0.set_nonblocking()
    q1.set_nonblocking()
    ports = _probe(q0, q1)

    # fresh, small rings for exact counts (resize reallocates them)
    sh(f"ip link set dev {dev} txqueuelen {RING}")
    sh(f"tc qdisc replace dev {dev} root handle 1: mq")
    spec = set_fq_codel(dev, parent="1:1")
    set_fq_codel(dev, parent="1:2")
    log(f"mq children: '{spec}'")

    r0 = env.reader(q0, paused=True, label="queue0")
    r1 = env.reader(q1, label="queue1")
    d0 = tx_dropped(dev)

    a = env.burst(N, ident=1, sport=ports[0], sndbuf=SNDBUF)
    assert a["ok"] == N, a
    drops_a = tx_dropped(dev) - d0
    c0 = qdisc_by_parent(dev, "1:1")
    log(f"after flow A (queue 0, reader paused): tx_dropped={drops_a} "
        f"queue0 child: {qsummary(c0)}")

    b = env.burst(N, ident=2, sport=ports[1], sndbuf=SNDBUF)
    assert b["ok"] == N, b
    wait_backlog_zero(dev, parent="1:2")
    drops_b = tx_dropped(dev) - d0 - drops_a
    expect_b = N - drops_b
    rb = r1.wait("id2", expect_b, stall_s=60)
    c0b = qdisc_by_parent(dev, "1:1")
    c1 = qdisc_by_parent(dev, "1:2")
    summary = (f"[mq bp={env.bp}] queue0: tx_dropped={drops_a} backlog={c0b['qlen']}p; "
               f"queue1: tx_dropped={drops_b} received={rb['per_id'][2]} of {N} "
               f"(wait {rb['result']}) child: {qsummary(c1)}")
    log(summary)
    record_property("queue0_tx_dropped", drops_a)
    record_property("queue0_backlog", c0b["qlen"])
    record_property("queue1_received", rb["per_id"][2])

    # queue 1 keeps flowing while queue 0 is blocked, on every kernel
    assert rb["result"] == "ok" and rb["per_id"][2] == expect_b, \
        f"queue 1 stalled or lost packets; {summary}"
    assert rb["per_id"][1] == 0, f"flow A leaked to queue 1; {summary}"
    if env.bp:
        assert drops_a == 0 and drops_b == 0, f"backpressure: ring drops; {summary}"
        assert c0b["qlen"] == N - RING, \
            f"backpressure: queue 0 child should hold {N - RING}p; {summary}"
        assert rb["per_id"][2] == N, summary
        expect_a = N
    else:
        assert drops_a == N - RING, f"stock: expected {N - RING} tail drops; {summary}"
        assert c0b["qlen"] == 0, summary
        expect_a = RING

    r0.go()
    ra = r0.wait("id1", expect_a, stall_s=60)
    wait_backlog_zero(dev)
    time.sleep(0.3)
    ra = r0.stat()
    final = (f"queue0 received={ra['per_id'][1]} expected={expect_a} "
             f"total tx_dropped={tx_dropped(dev) - d0}")
    log(final)
    assert ra["per_id"][1] == expect_a, final
    assert ra["per_id"][2] == 0, f"flow B leaked to queue 0; {final}"
    assert tx_dropped(dev) - d0 == drops_a + drops_b, final
