"""Scenario 6: ping RTT through the VPN under bulk TCP."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from .common import (BP, TUN_B, VPN, configs, iperf_finish, iperf_start, last_json, pct, say,
                     summ, term)

KEY, NAME = "6", "s6_latency"
PINGER = Path(__file__).resolve().parent.parent / "pinger.py"


def queue_summary(base: dict, samples: list[dict]) -> dict:
    """Median over the samples of each place a standing queue can form."""
    def med(f):
        v = [y for y in (f(x) for x in samples) if y is not None]
        return statistics.median(v) if v else None
    return {
        "tA_qdisc_pkts": med(lambda x: x["A"]["q_pkts"]),
        "tA_ring_pkts": med(lambda x: x["A"]["ring_x"] - base["A"]["ring_x"]),
        "A_udp_tx_kB": med(lambda x: x["A"]["udp_tx"] / 1024),
        "A_udp_rx_kB": med(lambda x: x["A"]["udp_rx"] / 1024),
        "B_udp_rx_kB": med(lambda x: x["B"]["udp_rx"] / 1024),
        "tB_ring_pkts": med(lambda x: x["B"]["ring_x"] - base["B"]["ring_x"]),
        "tB_qdisc_pkts": med(lambda x: x["B"]["q_pkts"]),
        # BQL of tA's queue 0 (None without byte_queue_limits)
        "tA_bql_limit": med(lambda x: (x["A"]["bql"] or {}).get("limit")),
        "tA_bql_inflight": med(lambda x: (x["A"]["bql"] or {}).get("inflight")),
        "samples": len(samples)}


def s6_configs(ctx) -> list[dict]:
    """Paced tunnel A (the standing queue at tA): stock (ring 500),
    stock-q25-fq_codel (full mode: a small ring + fq_codel without the
    flag: low latency, ring drops), and where the kernel has backpressure
    bp (BQL as the kernel has it: ours with, mainline without) and
    bp-nobql (ours only) at txqueuelen 25 (the hand-tuned reference), 500
    and 1000 (the tun/tap defaults nobody should have to tune). Unpaced
    tunnel A (the throughput check: nothing slows the reader, so a BQL
    limit that starves the ring would show as lost throughput): stock, bp
    and bp-nobql at txqueuelen 500."""
    paced = [{"name": "stock", "flag": 0, "qdisc": None, "qlen": 500}]
    if not ctx.quick:
        paced.append({"name": "stock-q25-fq_codel", "flag": 0, "qdisc": "fq_codel", "qlen": 25})
    if ctx.bp:
        for qlen in (25, 500, 1000):
            paced.append({"name": "bp", "flag": BP, "qdisc": "fq_codel", "qlen": qlen})
            if ctx.bql:
                paced.append({"name": "bp-nobql", "flag": BP, "qdisc": "fq_codel",
                              "qlen": qlen, "bql": "off"})
    rate = int(os.environ.get("S6_RATE_PPS", 1000))
    out = [{**c, "rate": rate} for c in paced]
    if rate:
        out += [{**c, "rate": 0} for c in configs(ctx, qlen=500)]
    return out


def run(ctx) -> dict:
    d_ping = float(os.environ.get("S6_PING_INTERVAL", 0.01))
    # pings per point and boot, split over the repetitions (the report pools
    # a boot's repetitions for p50/p99/p999)
    pings = int(os.environ.get("S6_PINGS", 200 if ctx.quick else 1000))
    per_rep = -(-pings // ctx.reps)
    d = per_rep * d_ping
    # the earlier method, for comparison only: S6_RATE_PPS=0 S6_SPIN_US=100
    spin = int(os.environ.get("S6_SPIN_US", 0) or 0)
    warm = float(os.environ.get("S6_WARMUP", 1.0 if ctx.quick else 1.5))
    cfgs = s6_configs(ctx)
    rate = cfgs[0]["rate"]
    res = {"scenario": NAME, "title": "ping RTT through the VPN under bulk TCP",
           "params": {"ping_s": round(d, 3), "warmup_s": warm,
                      "ping_mean_interval_s": d_ping, "pings_per_boot": per_rep * ctx.reps,
                      "tunnel_a_rate_pps": rate, "tunnel_a_spin_us": spin,
                      "rtt_source": "bench/pinger.py: ICMP echo, kernel receive "
                                    "timestamp, randomised send times"},
           "points": []}
    vpn = None
    try:
        for cfg in cfgs:
            # configurations with the same flags and pacing share one VPN
            if vpn is None or vpn.cfg["flag"] != cfg["flag"] or vpn.cfg["rate"] != cfg["rate"]:
                if vpn is not None:
                    vpn.close()
                vpn = VPN(ctx.tools, {**cfg, "bql": None}, rate_pps=cfg["rate"],
                          spin_us=spin if cfg["rate"] else 0)
            vpn.reconfigure(cfg)
            pacing = f"{cfg['rate']}pps" if cfg["rate"] else "none"
            pt = {"config": cfg["name"], "pacing": pacing, "qlen": cfg["qlen"],
                  "qdisc": vpn.qdisc, "reps": []}
            vpn.drain_all()
            for _ in range(ctx.reps):
                with vpn.a:
                    pr = vpn.procs.spawn([sys.executable, str(PINGER), TUN_B, str(per_rep),
                                          str(d_ping)])
                if json.loads(pr.stdout.readline() or "{}").get("event") != "ready":
                    raise RuntimeError(f"pinger did not start: {term(pr)}")
                base = vpn.probe()
                h = iperf_start(vpn, warm + d + 1)
                time.sleep(warm)
                pr.stdin.write("go\n")
                pr.stdin.flush()
                samples = []
                while pr.poll() is None:
                    time.sleep(0.25)
                    samples.append(vpn.probe())
                got = last_json(pr.communicate()[0])
                out = iperf_finish(vpn, h)
                rtts = [x / 1000.0 for x in got.get("rtt_us", [])]
                rep = {"p50_ms": pct(rtts, 50), "p99_ms": pct(rtts, 99),
                       "p999_ms": pct(rtts, 99.9), "max_ms": max(rtts) if rtts else None,
                       "pings_answered": len(rtts), "pings_sent": got.get("sent"),
                       "rtt_us": got.get("rtt_us", []),
                       "bulk_mbps": out.get("mbps"),
                       "tx_dropped": out.get("tx_dropped"),
                       "qdisc_drops": out.get("qdisc_drops")}
                rep.update({k: v for k, v in out.items() if k.endswith(("_per_kpkt", "_src"))})
                rep.update(queue_summary(base, samples[:-1] or samples))
                q = (rep["tA_qdisc_pkts"] or 0) + (rep["tA_ring_pkts"] or 0)
                rep["tA_queue_ms"] = 1000.0 * q / cfg["rate"] if cfg["rate"] else None
                pt["reps"].append(rep)
                vpn.drain_all()
            r = pt["reps"]
            say(f"s6 {cfg['name']} q{cfg['qlen']} pacing {pacing}: p50 {summ(r, 'p50_ms')} ms "
                f"p99 {summ(r, 'p99_ms')} ms p999 {summ(r, 'p999_ms')} ms "
                f"bulk {summ(r, 'bulk_mbps')} Mbit/s ring drops {summ(r, 'tx_dropped')}; "
                f"queued at tA: ring {summ(r, 'tA_ring_pkts')} qdisc {summ(r, 'tA_qdisc_pkts')} "
                f"pkts (= {summ(r, 'tA_queue_ms')} ms); B udp rx "
                f"{summ(r, 'B_udp_rx_kB')} kB, A udp rx {summ(r, 'A_udp_rx_kB')} kB; "
                f"tA BQL limit {summ(r, 'tA_bql_limit')} B inflight "
                f"{summ(r, 'tA_bql_inflight')} B")
            res["points"].append(pt)
    finally:
        if vpn is not None:
            vpn.close()
    return res
