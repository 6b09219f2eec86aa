"""NODROP benchmarks, run inside one guest (one kernel flavor): the driver.

The scenarios are bench/scenarios/s<N>_*.py, their shared helpers
bench/scenarios/common.py.

Environment (all optional except NODROP_TOOLS / NODROP_RESULTS in the lab):
  NODROP_TOOLS    dir with udpburst, tunreader, tunnel, vidstream [, vhostrx]
  NODROP_RESULTS  where the raw JSON goes (one file per scenario)
  NODROP_FLAVOR   label only, copied into the JSON
  QUICK=1         reduced set (a few minutes per flavor)
  REPS            repetitions per point in this boot, every scenario (default
                  2; the lab boots every kernel BOOTS times, docs/bench.md)
  DURATION        seconds per measured point, every scenario (default: per
                  scenario, see docs/bench.md; iperf3 rounds to whole seconds)
  SCENARIOS       comma list, e.g. "1,4,5,6" (default: all, 1,4,5,6,7,3,2)
  S4_SPIN_US      busy-wait per packet of tunnel A's reader in scenario 4 (60)
  S6_RATE_PPS     packet rate of tunnel A's paced reader in scenario 6 (1000;
                  0: no paced points, only the unpaced ones)
  S6_PINGS        pings per point in this boot, split over REPS (1000, QUICK 200)
  S6_PING_INTERVAL  mean gap between pings, s (0.01; randomised +-50 %)
  S6_WARMUP       seconds of bulk TCP before the pings of scenario 6 (1.5,
                  QUICK 1.0)
  S7_DELAY_US     sleep after every packet of the slow queue's reader in
                  scenario 7 (100)
  NODROP_CLOCK    the guest's clock as the lab booted it (icount | wall),
                  recorded in the JSON; the report derives instructions per
                  packet from guest time only under icount
  NODROP_BOOT     which boot of this kernel this is (1, 2, ...), recorded

Writes <scenario>.json per scenario (elapsed_s in each) and run.json (total
time of the run).

Feature detection only: TUNGETFEATURES & IFF_BACKPRESSURE (0x0080) decides
whether the "bp" configuration (flag + fq_codel) is measured next to
"stock" (and "stock+fq_codel" in the pktgen scenarios); a tun with
backpressure that has the "bql" ethtool private flag adds "bp-nobql". The
flavor name is never looked at.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenarios import BY_KEY, DEFAULT_ORDER  # noqa: E402
from scenarios.common import REPO, T0, Ctx, say, tl  # noqa: E402


def main() -> int:
    env = os.environ
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", default=env.get("QUICK", "") not in ("", "0"))
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--duration", type=float, default=float(env.get("DURATION", 0) or 0))
    ap.add_argument("--scenarios", default=env.get("SCENARIOS", ",".join(DEFAULT_ORDER)))
    ap.add_argument("--tools", default=env.get("NODROP_TOOLS", str(REPO / "tools" / "build")))
    ap.add_argument("--results", default=env.get("NODROP_RESULTS") or env.get("NODROP_BENCH_OUT") or ".")
    a = ap.parse_args()
    if a.reps is None:
        a.reps = int(env.get("REPS") or 2)
    out = Path(a.results)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(a.quick, a.reps, a.duration, a.tools)
    missing = [t for t in ("tunreader", "tunnel", "vidstream")
               if not os.access(os.path.join(a.tools, t), os.X_OK)]
    if missing:
        say(f"missing tools in {a.tools}: {missing} (make -C tools OUT=...)")
        return 2
    for tool in ("iperf3", "ping", "tc", "ip"):
        if not shutil.which(tool):
            say(f"warning: {tool} not found")
    uname = os.uname()
    common = {"flavor": env.get("NODROP_FLAVOR", ""), "uname_r": uname.release,
              "uname_v": uname.version, "bp_supported": ctx.bp,
              "features": hex(tl.get_features()), "quick": a.quick, "reps": a.reps,
              "cpus": os.cpu_count(), "boot": int(env.get("NODROP_BOOT") or 1),
              "bql_switch": ctx.bql,
              "clock": env.get("NODROP_CLOCK", "wall"),
              "default_qdisc": Path("/proc/sys/net/core/default_qdisc").read_text().strip()
              if Path("/proc/sys/net/core/default_qdisc").exists() else None}
    say(f"kernel {uname.release}, TUNGETFEATURES {common['features']}, backpressure "
        f"{'supported: measuring stock and bp' if ctx.bp else 'not supported: stock only'}, "
        f"quick={a.quick} reps={a.reps}")
    rc = 0
    started = time.time()
    elapsed: dict[str, float] = {}
    for s in [x.strip() for x in a.scenarios.split(",") if x.strip()]:
        mod = BY_KEY.get(s)
        if not mod:
            say(f"unknown scenario {s}")
            continue
        t = time.monotonic()
        say(f"scenario {s}: {mod.NAME}")
        try:
            res = mod.run(ctx)
        except Exception as e:  # noqa: BLE001 - record and go on with the others
            import traceback
            traceback.print_exc()
            res = {"scenario": mod.NAME, "error": f"{type(e).__name__}: {e}", "points": []}
            rc = 1
        res.update(common)
        res["elapsed_s"] = round(time.monotonic() - t, 1)
        name = res.get("scenario", mod.NAME)
        (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        elapsed[name] = res["elapsed_s"]
        say(f"scenario {s} done in {res['elapsed_s']}s -> {out / (name + '.json')}"
            + (f" (skipped: {res['skipped']})" if res.get("skipped") else ""))
    total = round(time.monotonic() - T0, 1)
    # run.json (no "scenario" key: not a scenario) -- how long this took
    (out / "run.json").write_text(json.dumps(
        {**common, "started_unix": round(started), "total_s": total,
         "scenarios_elapsed_s": elapsed, "scenarios": a.scenarios,
         "duration_override_s": a.duration or None}, indent=1) + "\n")
    say(f"all done in {total:.0f}s ({total / 60:.1f} min): "
        + ", ".join(f"{k} {v:.0f}s" for k, v in elapsed.items()))
    return rc


if __name__ == "__main__":
    sys.exit(main())
