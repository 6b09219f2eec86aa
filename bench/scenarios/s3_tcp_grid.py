"""Scenario 3: TCP through the VPN, txqueuelen x netem delay."""

from __future__ import annotations

from .common import VPN, configs, iperf, isec, say, summ

KEY, NAME = "3", "s3_tcp_grid"


def run(ctx) -> dict:
    # 12 points x reps x configs: the longest scenario; 2 s points (1 s in
    # QUICK) keep `make bench` of three flavors within its time budget
    d = isec(ctx.dur(2.0, 1.0))
    qlens = [10, 1000] if ctx.quick else [1, 10, 100, 1000]
    delays = [60] if ctx.quick else [0, 60, 120]
    res = {"scenario": NAME, "title": "TCP through the tunnel: txqueuelen x netem delay",
           "params": {"duration_s": d, "qlens": qlens, "delays_ms": delays, "reps": ctx.reps},
           "points": []}
    for cfg in configs(ctx):
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
