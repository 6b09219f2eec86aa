"""Scenario 7: multi-queue tap, flows steered to queues by tc filters.

A tap pg0 with two queues (IFF_MULTI_QUEUE), each read by its own
tunreader: queue 0 at full speed, queue 1 slowly (sleeping S7_DELAY_US after
every packet). Root qdisc multiq (one band per TX queue), and two filters
that pin the flows to queues the way operators do it:
    u32    udp dport 9  -> action skbedit queue_mapping 0
    flower udp dport 10 -> action skbedit queue_mapping 1
pktgen (1 thread, queue_xmit, 64-byte frames) alternates the two ports.
stock: no flag, multiq's default pfifo bands; stock+fq_codel: no flag, an
fq_codel per band; bp: IFF_BACKPRESSURE and an fq_codel per band; bp-nobql:
bp with tun's "bql" private flag off. The question: when the slow queue is stopped, does the
fast queue keep its rate (multiq dequeues from bands whose queue runs), and
where do the slow flow's excess packets go (ring drops vs qdisc drops)?
"""

from __future__ import annotations

import os

from .common import (IFF_NO_PI, IFF_TAP, NS, Procs, bql_switch, configs,
                     mech_snap, pg_counts, pktgen_available, pktgen_reps, pktgen_setup,
                     qdisc_counts, say, sh, summ, tl)

KEY, NAME = "7", "s7_mq_steering"
IFF_MULTI_QUEUE = 0x0100


def steer(dev: str, fq_codel: bool) -> str:
    sh(f"tc qdisc replace dev {dev} root handle 1: multiq")
    if fq_codel:
        for band in (1, 2):
            sh(f"tc qdisc replace dev {dev} parent 1:{band} fq_codel")
    sh(f"tc filter add dev {dev} parent 1: protocol ip prio 1 u32 "
       "match ip protocol 17 0xff match ip dport 9 0xffff action skbedit queue_mapping 0")
    sh(f"tc filter add dev {dev} parent 1: protocol ip prio 2 flower ip_proto udp "
       "dst_port 10 action skbedit queue_mapping 1")
    return "multiq" + ("+fq_codel" if fq_codel else "")


def point(ctx, cfg: dict, delay_us: int, d: float) -> dict:
    ns, procs = NS("mq"), Procs()
    pt = {"config": cfg["name"], "queues": 2, "slow_delay_us": delay_us, "reps": []}
    try:
        with ns:
            flags = IFF_TAP | IFF_NO_PI | IFF_MULTI_QUEUE | cfg["flag"]
            readers = []
            for q, extra in ((0, []), (1, ["--delay-us", str(delay_us)])):
                argv = [os.path.join(ctx.tools, "tunreader"), "--dev", "pg0", "--flags",
                        hex(flags), "--tap", *extra]
                readers.append(tl.Reader(procs.spawn(argv, text=False), f"pg0 q{q}"))
            tl.setup_ip("pg0", tap=True, txqueuelen=500)
            pt["qdisc"] = steer("pg0", cfg.get("qdisc") == "fq_codel")
            bql_switch("pg0", cfg.get("bql") == "off")
            devs = pktgen_setup("pg0", 1, "queue_xmit", udp_dst=(9, 10))

            def snap():
                r = [x.stat()["pkts"] for x in readers]
                s = tl.dev_stats("pg0")
                return {"recv": r[0] + r[1], "recv_q0": r[0], "recv_q1": r[1],
                        "tx_dropped": s["tx_dropped"],
                        "qdisc_drops": qdisc_counts("pg0")["drops"],
                        "pg_sent": pg_counts(devs[0])[0], "mech": mech_snap("pg0")}
            pt["reps"] = pktgen_reps("pg0", devs, snap, ctx.reps, d, 0.3)
            # the filters' action counters: proof that the steering happened
            pt["filters"] = sh("tc -s filter show dev pg0 parent 1:", check=False)[-1500:]
            for x in readers:
                x.quit()
    finally:
        procs.close()
        ns.close()
    return pt


def run(ctx) -> dict:
    res = {"scenario": NAME, "title": "multi-queue tap, tc filter skbedit queue_mapping "
           "steering, one slow queue", "points": []}
    why = pktgen_available()
    if why:
        res["skipped"] = why
        return res
    d = ctx.dur(1.5, 1.0)
    delay = int(os.environ.get("S7_DELAY_US", 100))
    res["params"] = {"duration_s": d, "pkt_size": 64, "txqueuelen": 500, "queues": 2,
                     "slow_queue_delay_us": delay,
                     "filters": "u32 dport 9 -> queue 0, flower dport 10 -> queue 1"}
    for cfg in configs(ctx, control=True):
        pt = point(ctx, cfg, delay, d)
        r = pt["reps"]
        say(f"s7 {cfg['name']}: recv q0 {summ(r, 'recv_q0_per_s')} pps, q1 "
            f"{summ(r, 'recv_q1_per_s')} pps, ring drops {summ(r, 'tx_dropped_per_s')}/s, "
            f"qdisc drops {summ(r, 'qdisc_drops_per_s')}/s, stops/kpkt "
            f"{summ(r, 'stops_per_kpkt')}")
        res["points"].append(pt)
    return res
