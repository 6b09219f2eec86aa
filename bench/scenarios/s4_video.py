"""Scenario 4: bursty video (tools/vidstream) over the VPN, ring 25, slow reader."""

from __future__ import annotations

import os
import subprocess
import time

from .common import TUN_B, VPN, configs, delta, last_json, say, summ, term

KEY, NAME = "4", "s4_video"


def run(ctx) -> dict:
    d = ctx.dur(3.0, 2.0)
    fpss = [60] if ctx.quick else [30, 60]
    spin = int(os.environ.get("S4_SPIN_US", 60))
    res = {"scenario": NAME, "title": "bursty video over the VPN (txqueuelen 25, slow tunnel reader)",
           "params": {"duration_s": d, "qlen": 25, "frame_pkts": 30, "size": 1200,
                      "fps": fpss, "reader_spin_us": spin},
           "points": []}
    for cfg in configs(ctx, qlen=25):
        vpn = VPN(ctx.tools, cfg, spin_us=spin)
        try:
            vpn.set_qlen(25)
            for fps in fpss:
                pt = {"config": cfg["name"], "fps": fps, "qdisc": vpn.qdisc, "reps": []}
                for _ in range(ctx.reps):
                    with vpn.b:
                        rcv = vpn.procs.spawn([os.path.join(ctx.tools, "vidstream"), "--recv",
                                               "--bind", TUN_B, "--port", "6000"])
                        rcv.stdout.readline()
                    c0 = vpn.counters()
                    with vpn.a:
                        snd = subprocess.run(
                            [os.path.join(ctx.tools, "vidstream"), "--send", "--dst", TUN_B,
                             "--port", "6000", "--fps", str(fps), "--frame-pkts", "30",
                             "--size", "1200", "--duration", str(d)],
                            capture_output=True, text=True, timeout=d * 20 + 60)
                    vpn.drain()
                    time.sleep(0.5)
                    c1 = vpn.counters()
                    r = last_json(term(rcv))
                    s = last_json(snd.stdout)
                    frames, pkts = s.get("frames", 0), s.get("pkts", 0)
                    rep = {"frames_sent": frames, "pkts_sent": pkts,
                           "pkts_recv": r.get("pkts", 0),
                           "frames_complete": r.get("complete", 0),
                           "loss_pct": 100.0 * (1 - r.get("pkts", 0) / pkts) if pkts else None,
                           "complete_pct": 100.0 * r.get("complete", 0) / frames if frames else None,
                           # latency of complete frames only; none complete -> no value
                           "lat_ms_p50": r.get("lat_ms_p50") if r.get("complete") else None,
                           "lat_ms_p99": r.get("lat_ms_p99") if r.get("complete") else None,
                           "late_frames": s.get("late", 0), "hist": r.get("hist")}
                    rep.update(delta(c0, c1))
                    pt["reps"].append(rep)
                say(f"s4 {cfg['name']} {fps}fps: loss {summ(pt['reps'], 'loss_pct')} % "
                    f"complete {summ(pt['reps'], 'complete_pct')} % ring drops "
                    f"{summ(pt['reps'], 'tx_dropped')}")
                res["points"].append(pt)
        finally:
            vpn.close()
    return res
