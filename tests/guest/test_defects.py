"""Mainline's two measured backpressure defects, as strict tests (issue 14).

A kernel that reports IFF_BACKPRESSURE in TUNGETFEATURES promises that, with
the flag and a qdisc, the driver does not lose packets: the qdisc holds the
backlog. Debian's 7.3.4 (mainline's implementation) breaks that promise in
two cases, which our series (6.12, and the 7.3 fixes for net) keep:

test_defect_concurrent_bypass: two pktgen threads in start_xmit mode (they
  bypass the qdisc and call the driver concurrently: tun is LLTX), 200000
  packets of 64 bytes each, on one tap queue (txqueuelen 500) with fq_codel
  and a reader. Must be 0 ring drops (tx_dropped). mainline-7.3: drops
  (16 [11-20] packets/s in the bench).
test_defect_vhost_unconsume: vhost-net holds a batch taken from a ring at its
  stop level when its backend is removed; ptr_ring_unconsume() frees, without
  counting them, the entries that no longer fit. Must be 0 packets missing
  (sent - received - tx_dropped - qdisc drops). mainline-7.3: 51.

Kernels without IFF_BACKPRESSURE skip both (nothing is promised there).
These tests are expected to FAIL on mainline-7.3 and pass on nodrop-6.12 and
nodrop-7.3; test_concurrent.py and test_vhost.py record the same figures on
every kernel without failing. lab/flavors.toml lists both as known_failures
of mainline-7.3, so `make test FLAVORS=mainline-7.3` reports them as known
defects reproduced (and notes it if one did not fail), not as failures.
"""

from __future__ import annotations

import os

import pytest

from test_concurrent import pktgen_two_threads
from test_vhost import (DA_BUFS, DA_RATE, DA_RING, VHOST_DEV, check_clean,
                        fresh_burst, giveback_sequence, make_tap)
from tunlib import lacks, log, set_fq_codel


@pytest.fixture(autouse=True)
def _need_flag(env):
    if not env.bp:
        lacks("backpressure", "kernel without IFF_BACKPRESSURE (TUNGETFEATURES): nothing promised")


# the bench's s1 point (64-byte packets, txqueuelen 500, a reader that cannot
# keep up, so the queue stops and wakes all the time); mainline loses about 1
# packet in 10^4 there, so 2 x 200000 packets show it in every run
BYPASS_COUNT = 200000
BYPASS_PKT_SIZE = 64
BYPASS_RING = 500


def test_defect_concurrent_bypass(env, record_property):
    res = pktgen_two_threads(env, record_property, name="nddef0", count=BYPASS_COUNT,
                             pkt_size=BYPASS_PKT_SIZE, ring=BYPASS_RING)
    assert res["drops"] == 0, (
        f"IFF_BACKPRESSURE + fq_codel, but {res['drops']} ring drops with 2 concurrent "
        f"qdisc-bypass producers; {res['summary']}")


def test_defect_vhost_unconsume(env, record_property):
    if not os.path.exists(VHOST_DEV):
        lacks("vhost-net", f"no {VHOST_DEV} (kernel without CONFIG_VHOST_NET)")
    t = make_tap(env, "nddef1", env.bp_flag(), True, DA_RING)
    dev = t.name
    set_fq_codel(dev)
    rx = env.vhostrx(t, rate=DA_RATE, bufs=DA_BUFS)
    fresh_burst(env, dev, rx, 2, "burst before the backend changes")

    # the deterministic sequence of test_vhost_load_events[detach_attach],
    # phase B (steps in test_vhost.py), without the load before it
    g = giveback_sequence(env, dev, rx)
    st, got, sent, missing = g["st"], g["got"], g["sent"], g["missing"]
    drops, qdrops, steps = g["drops"], g["qdrops"], g["steps"]
    summary = (f"[vhost, IFF_BACKPRESSURE, ring {DA_RING}, {DA_BUFS} buffers] "
               f"{'; '.join(steps)}; received={got}/{sent} tx_dropped={drops} "
               f"qdisc_drops={qdrops} MISSING (freed uncounted)={missing}")
    log(summary)
    record_property("unconsume_missing", missing)
    check_clean(st)
    assert drops == 0 and qdrops == 0, f"backpressure: drops; {summary}"
    assert missing == 0, f"vhost-net backend detach freed {missing} packets silently; {summary}"
    fresh_burst(env, dev, rx, 4, "burst after the backend changes")
