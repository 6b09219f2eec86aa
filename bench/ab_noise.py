"""How far apart measurements of the same configuration in the same boot
land, next to the difference between configurations on the same point:
each pktgen point runs the variants in the order A B … B A, twice (two
variants: A B B A A B B A), 3 repetitions each, as make bench measures a
point (guest instructions per delivered packet, icount). Not part of make
bench: docs/bench.md asks for it before a per-point change under ~3 % is
claimed, and for a no-op control of the change's size. Run in the guest:

  CLOCK=icount lab/lab run nodrop-6.12 -- 'cd <repo> && python3 bench/ab_noise.py'

A variant is NAME=CONFIG[:PARAM=VALUE,...]: a bench configuration
(bench/scenarios/common.py) and tun module parameters written before each
of its runs and reset to 0 after the point; default A=bp B=bp-nobql.
--points picks points by tag prefix (default all four).
Output: $NODROP_RESULTS/ab_noise.json."""
import argparse
import json
import os
import statistics
import subprocess
import sys
from types import SimpleNamespace

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
from scenarios import common as c  # noqa: E402

POINTS = [  # (tag, threads, mode, consumer)
    ("s1 2thr start_xmit", 2, "start_xmit", "tunreader"),
    ("s1 2thr queue_xmit", 2, "queue_xmit", "tunreader"),
    ("s1 1thr queue_xmit", 1, "queue_xmit", "tunreader"),
    ("s2 2thr start_xmit", 2, "start_xmit", "vhostrx"),
]
PARAMS = "/sys/module/tun/parameters/"


def variant(text: str):
    """NAME=CONFIG[:PARAM=VALUE,...] -> (name, config, {param: value})."""
    name, _, rest = text.partition("=")
    config, _, params = rest.partition(":")
    if not name or not config:
        raise SystemExit(f"ab_noise: bad variant {text!r} (NAME=CONFIG[:PARAM=VALUE,...])")
    return name, config, dict(p.split("=", 1) for p in params.split(",") if p)


def set_params(params: dict):
    for p, v in params.items():
        with open(PARAMS + p, "w") as f:
            f.write(v)


def spread(xs):
    return (max(xs) - min(xs)) / statistics.median(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", type=variant,
                    default=[("A", "bp", {}), ("B", "bp-nobql", {})])
    ap.add_argument("--points", nargs="*", default=[t for t, *_ in POINTS])
    a = ap.parse_args()
    tools = os.environ.get("NODROP_TOOLS", os.path.join(REPO, "tools", "build"))
    subprocess.run(["modprobe", "vhost_net"], capture_output=True, check=False)
    cfgs = {x["name"]: x for x in c.configs(SimpleNamespace(bp=True, bql=True))}
    names = [n for n, _, _ in a.variants]
    order = (names + names[::-1]) * 2
    by_name = {n: (cfg, params) for n, cfg, params in a.variants}
    zero = {p: "0" for _, _, params in a.variants for p in params}
    out = {"variants": {n: f"{cfg} {params}" for n, cfg, params in a.variants}}
    for tag, threads, mode, consumer in POINTS:
        if not any(tag.startswith(p) for p in a.points):
            continue
        runs = []
        for name in order:
            cfg, params = by_name[name]
            set_params({**zero, **params})
            pt = c.pktgen_point(tools, cfgs[cfg], threads, mode, False, 3, 1.5, 0.3,
                                consumer=consumer)
            g = statistics.median(r["gns_per_pkt"] for r in pt["reps"])
            runs.append((name, g, pt["reps"]))
            c.say(f"{tag} {name}: guest instructions/pkt {g:.0f}")
        set_params(zero)
        med = {n: statistics.median(g for m, g, _ in runs if m == n) for n in names}
        res = {"order": runs,
               "spread": {n: spread([g for m, g, _ in runs if m == n]) for n in names},
               "ratio_to_first": {n: med[n] / med[names[0]] for n in names[1:]}}
        if len(names) == 2:  # the adjacent pairs A B, B A, A B, B A
            res["pair_ratios"] = [x[1] / y[1] if x[0] == names[0] else y[1] / x[1]
                                  for x, y in zip(runs[::2], runs[1::2])]
        out[tag] = res
        c.say(f"{tag}: {json.dumps({k: v for k, v in res.items() if k != 'order'})}")
    with open(os.path.join(os.environ["NODROP_RESULTS"], "ab_noise.json"), "w") as f:
        json.dump(out, f, indent=1)


main()
