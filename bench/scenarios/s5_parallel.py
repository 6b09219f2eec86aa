"""Scenario 5: parallel TCP streams through one tun queue, the configurations interleaved."""

from __future__ import annotations

from .common import VPN, configs, iperf, isec, say, summ

KEY, NAME = "5", "s5_parallel"


def run(ctx) -> dict:
    """stock, stock+fq_codel, bp and bp-nobql side by side on the same
    kernel, interleaved (stock+fq_codel: the control that tells fq_codel's
    own work and locking from backpressure's, docs/bench.md):
    the VPNs exist at once and every repetition measures each in turn, the
    order rotated and reversed from one repetition to the next, so that
    drift hits all alike. The report pairs repetition i of bp with
    repetition i of each other configuration."""
    d = isec(ctx.dur(2.0, 1.0))
    streams = [1, 8] if ctx.quick else [1, 2, 4, 8]
    cfgs = configs(ctx, qlen=500, control=True)
    res = {"scenario": NAME, "title": "parallel TCP streams through one tun queue",
           "params": {"duration_s": d, "streams": streams, "qlen": 500,
                      "interleaved": len(cfgs) > 1},
           "points": []}
    vpns: dict[str, VPN] = {}
    try:
        for cfg in cfgs:
            vpns[cfg["name"]] = VPN(ctx.tools, cfg)
        for n in streams:
            pts = {c["name"]: {"config": c["name"], "streams": n,
                               "qdisc": vpns[c["name"]].qdisc, "reps": []} for c in cfgs}
            for i in range(ctx.reps):
                order = cfgs[i // 2 % len(cfgs):] + cfgs[:i // 2 % len(cfgs)]
                order = order if i % 2 == 0 else order[::-1]
                for k, cfg in enumerate(order):
                    vpn = vpns[cfg["name"]]
                    r = iperf(vpn, d, streams=n)
                    r["pair"], r["slot"] = i, k
                    vpn.drain()
                    pts[cfg["name"]]["reps"].append(r)
            for c in cfgs:
                r = pts[c["name"]]["reps"]
                say(f"s5 {c['name']} -P {n}: {summ(r, 'mbps')} Mbit/s "
                    f"ring drops {summ(r, 'tx_dropped')}")
            for den in (c for c in pts if c != "bp" and "bp" in pts):
                ratios = [{"ratio": b["mbps"] / a["mbps"]}
                          for a, b in zip(pts[den]["reps"], pts["bp"]["reps"])
                          if a.get("mbps") and b.get("mbps") is not None]
                say(f"s5 -P {n}: bp/{den} per pair {summ(ratios, 'ratio')}")
            res["points"] += list(pts.values())
    finally:
        for v in vpns.values():
            v.close()
    return res
