"""Scenario 2: pktgen -> TAP + vhost-net (tools/vhostrx as the guest side)."""

from __future__ import annotations

import os
import subprocess

from .common import configs, pktgen_available, pktgen_point, say, say_pktgen

KEY, NAME = "2", "s2_pktgen_vhost"


def run(ctx) -> dict:
    res = {"scenario": NAME, "title": "pktgen -> TAP + vhost-net", "points": []}
    if not os.access(os.path.join(ctx.tools, "vhostrx"), os.X_OK):
        res["skipped"] = "pending vhostrx (tools/vhostrx not built yet)"
        return res
    if not os.path.exists("/dev/vhost-net"):
        subprocess.run(["modprobe", "vhost_net"], capture_output=True, check=False)
    why = None if os.path.exists("/dev/vhost-net") else "no /dev/vhost-net in this kernel"
    why = why or pktgen_available()
    if why:
        res["skipped"] = why
        return res
    d = ctx.dur(1.5, 1.0)
    cases = [(1, "queue_xmit"), (2, "start_xmit")]
    if not ctx.quick:
        cases = [(1, "queue_xmit"), (2, "queue_xmit"), (2, "start_xmit")]
    res["params"] = {"duration_s": d, "pkt_size": 64, "txqueuelen": 500,
                     "consumer": "tools/vhostrx (vhost-net RX, 256-entry virtqueue)",
                     "cases": cases}
    for cfg in configs(ctx, control=True):
        for threads, mode in cases:
            tag = f"s2 {cfg['name']} threads={threads} {mode} vhost-net"
            say(tag)
            pt = pktgen_point(ctx.tools, cfg, threads, mode, False, ctx.reps, d, 0.3,
                              consumer="vhostrx")
            say_pktgen(tag, pt)
            res["points"].append(pt)
    return res
