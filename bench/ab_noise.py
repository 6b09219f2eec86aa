"""How far apart two measurements of the same configuration in the same boot
land, next to BQL's cost on the same point: each point runs bp and bp-nobql
in the order A B B A A B B A (A = bp, B = bp-nobql), 3 repetitions each, as
make bench measures a point (guest instructions per delivered packet,
icount). Not part of make bench: docs/bench.md asks for it before a
per-point change under ~3 % is claimed. Run in the guest:
CLOCK=icount lab/lab run nodrop-6.12 -- 'cd <repo> && python3 bench/ab_noise.py'
(output: $NODROP_RESULTS/ab_noise.json)"""
import json
import os
import statistics
import subprocess
import sys
from types import SimpleNamespace

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
from scenarios import common as c  # noqa: E402

tools = os.environ.get("NODROP_TOOLS", os.path.join(REPO, "tools", "build"))
subprocess.run(["modprobe", "vhost_net"], capture_output=True, check=False)
cfgs = {x["name"]: x for x in c.configs(SimpleNamespace(bp=True, bql=True))}
points = [  # (tag, threads, mode, consumer)
    ("s1 2thr start_xmit", 2, "start_xmit", "tunreader"),
    ("s1 2thr queue_xmit", 2, "queue_xmit", "tunreader"),
    ("s1 1thr queue_xmit", 1, "queue_xmit", "tunreader"),
    ("s2 2thr start_xmit", 2, "start_xmit", "vhostrx"),
]
out = {}
for tag, threads, mode, consumer in points:
    runs = []
    for name in ["bp", "bp-nobql", "bp-nobql", "bp", "bp", "bp-nobql", "bp-nobql", "bp"]:
        pt = c.pktgen_point(tools, cfgs[name], threads, mode, False, 3, 1.5, 0.3,
                            consumer=consumer)
        g = statistics.median(r["gns_per_pkt"] for r in pt["reps"])
        runs.append((name, g))
        c.say(f"{tag} {name}: guest instructions/pkt {g:.0f}")
    a = [g for n, g in runs if n == "bp"]
    b = [g for n, g in runs if n == "bp-nobql"]
    out[tag] = {"order": runs,
                "bp_spread": (max(a) - min(a)) / statistics.median(a),
                "nobql_spread": (max(b) - min(b)) / statistics.median(b),
                "ratio_of_medians": statistics.median(a) / statistics.median(b),
                "pair_ratios": [runs[i][1] / runs[i + 1][1] if runs[i][0] == "bp" else
                                runs[i + 1][1] / runs[i][1] for i in range(0, 8, 2)]}
    c.say(f"{tag}: {json.dumps({k: v for k, v in out[tag].items() if k != 'order'})}")
with open(os.path.join(os.environ["NODROP_RESULTS"], "ab_noise.json"), "w") as f:
    json.dump(out, f, indent=1)
