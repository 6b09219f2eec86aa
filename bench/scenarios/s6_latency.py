"""Scenario 6: ping RTT through the VPN under bulk TCP."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import time

from .common import (BP, TUN_B, VPN, iperf_finish, iperf_start, isec, pct, say,
                     summ)

KEY, NAME = "6", "s6_latency"
RTT_RE = re.compile(r"time=([0-9.]+) ms")


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


def run(ctx) -> dict:
    d = isec(ctx.dur(3.0, 2.0))
    cfgs = [{"name": "stock", "flag": 0, "qdisc": None, "qlen": 500}]
    if not ctx.quick:
        # a small ring + fq_codel without the flag: low latency, ring drops
        cfgs.append({"name": "stock-q25-fq_codel", "flag": 0, "qdisc": "fq_codel", "qlen": 25})
    if ctx.bp:
        # "bp": backpressure + fq_codel, with BQL where the kernel has it
        # (ours); "bp-nobql": ours without BQL (tun's "bql" private flag
        # off, see docs/bench.md), the ring then holds up to txqueuelen packets.
        # q25 without BQL is the hand-tuned reference; q500/q1000 are the
        # tun/tap defaults nobody should have to tune.
        for qlen in (25, 500, 1000):
            cfgs.append({"name": "bp", "flag": BP, "qdisc": "fq_codel", "qlen": qlen})
            cfgs.append({"name": "bp-nobql", "flag": BP, "qdisc": "fq_codel", "qlen": qlen,
                         "bql": "off"})
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
    res = {"scenario": NAME, "title": "ping RTT through the VPN under bulk TCP",
           "params": {"duration_s": d, "warmup_s": warm, "ping_interval_s": interval,
                      "tunnel_a_rate_pps": rate, "tunnel_a_spin_us": spin},
           "points": []}
    vpn = None
    try:
        for cfg in cfgs:
            # configurations with the same flags share one VPN
            if vpn is None or vpn.cfg["flag"] != cfg["flag"]:
                if vpn is not None:
                    vpn.close()
                vpn = VPN(ctx.tools, {**cfg, "bql": None}, rate_pps=rate, spin_us=spin)
            if cfg.get("bql") == "off" and not vpn.has_bql():
                say(f"s6 {cfg['name']} q{cfg['qlen']}: skipped (no byte_queue_limits)")
                continue
            vpn.reconfigure(cfg)
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
                rep.update({k: out.get(k) for k in ("stops_per_kpkt", "wakes_per_kpkt",
                                                    "requeues_per_kpkt", "sw_src")})
                rep.update(queue_summary(base, samples[:-1] or samples))
                q = (rep["tA_qdisc_pkts"] or 0) + (rep["tA_ring_pkts"] or 0)
                rep["tA_queue_ms"] = 1000.0 * q / rate if rate else None
                pt["reps"].append(rep)
                vpn.drain_all()
            r = pt["reps"]
            say(f"s6 {cfg['name']} q{cfg['qlen']}: p50 {summ(r, 'p50_ms')} ms p99 {summ(r, 'p99_ms')} ms "
                f"bulk {summ(r, 'bulk_mbps')} Mbit/s ring drops {summ(r, 'tx_dropped')}; "
                f"queued at tA: ring {summ(r, 'tA_ring_pkts')} qdisc {summ(r, 'tA_qdisc_pkts')} "
                f"pkts (= {summ(r, 'tA_queue_ms')} ms at {rate} pps); B udp rx "
                f"{summ(r, 'B_udp_rx_kB')} kB, A udp rx {summ(r, 'A_udp_rx_kB')} kB; "
                f"tA BQL limit {summ(r, 'tA_bql_limit')} B inflight "
                f"{summ(r, 'tA_bql_inflight')} B")
            res["points"].append(pt)
    finally:
        if vpn is not None:
            vpn.close()
    return res
