"""Scenario 5: parallel TCP streams through one tun queue, stock and bp interleaved."""

from __future__ import annotations

from .common import VPN, configs, iperf, isec, say, summ

KEY, NAME = "5", "s5_parallel"


def run(ctx) -> dict:
    """stock and bp side by side on the same kernel, interleaved: both VPNs
    exist at once and every repetition measures one then the other, in
    alternating order (stock, bp / bp, stock / ...), so that drift of the
    host (other VMs, CPU frequency) hits both alike. The report pairs
    repetition i of bp with repetition i of stock (bp/stock ratio)."""
    d = isec(ctx.dur(2.0, 1.0))
    streams = [1, 8] if ctx.quick else [1, 2, 4, 8]
    cfgs = configs(ctx.bp, qlen=500)
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
                order = cfgs if i % 2 == 0 else cfgs[::-1]
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
            if len(cfgs) > 1:
                ratios = [{"ratio": b["mbps"] / a["mbps"]}
                          for a, b in zip(pts["stock"]["reps"], pts["bp"]["reps"])
                          if a.get("mbps") and b.get("mbps") is not None]
                say(f"s5 -P {n}: bp/stock per pair {summ(ratios, 'ratio')}")
            res["points"] += list(pts.values())
    finally:
        for v in vpns.values():
            v.close()
    return res
