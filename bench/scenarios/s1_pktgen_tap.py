"""Scenario 1: pktgen -> TAP, user-space reader (tools/tunreader)."""

from __future__ import annotations

from .common import configs, pktgen_available, pktgen_point, say, say_pktgen

KEY, NAME = "1", "s1_pktgen_tap"


def run(ctx) -> dict:
    res = {"scenario": NAME, "title": "pktgen -> TAP, user-space reader", "points": []}
    why = pktgen_available()
    if why:
        res["skipped"] = why
        return res
    d = ctx.dur(1.5, 1.0)
    # (threads, xmit_mode, vnet_hdr reader, qdisc bypass allowed)
    cases = [(1, "queue_xmit", False, True), (2, "start_xmit", False, True)]
    if not ctx.quick:
        cases = [(1, "queue_xmit", False, True), (1, "queue_xmit", True, True),
                 (2, "queue_xmit", False, True), (2, "start_xmit", False, True),
                 (2, "queue_xmit", True, True), (2, "start_xmit", True, True),
                 # two producers through the qdisc with its empty-queue bypass
                 # off: what BQL costs beyond the qdisc's own work (the ring
                 # keeps the qdisc empty without BQL, so the core bypasses it)
                 (2, "queue_xmit", False, False)]
    res["params"] = {"duration_s": d, "pkt_size": 64, "txqueuelen": 500, "cases": cases}
    for cfg in configs(ctx, control=True):
        for threads, mode, vnet, bypass in cases:
            if not bypass and not cfg.get("qdisc"):
                continue    # stock keeps the device's default qdisc as it is
            tag = f"s1 {cfg['name']} threads={threads} {mode} vnet={vnet}" + \
                ("" if bypass else " qdisc bypass off")
            say(tag)
            pt = pktgen_point(ctx.tools, cfg, threads, mode, vnet, ctx.reps, d, 0.3,
                              bypass=bypass)
            say_pktgen(tag, pt)
            res["points"].append(pt)
    return res
