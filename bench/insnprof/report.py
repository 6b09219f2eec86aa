#!/usr/bin/env python3
"""Guest instructions per delivered packet, per kernel function, from
bench/insnprof snapshots: each window of a pktgen point is bracketed by the
snapshots the bench's marks triggered (code 2*rep before, 2*rep+1 after); blocks are
attributed to the function of their first instruction (the guest's
/proc/kallsyms), user space to "[user]".

  report.py <run dir A> <run dir B> [--point 'stock threads=1 queue_xmit']

Each run dir holds kallsyms, prof.<n>.<code>, run.json and the pktgen
scenarios' JSON (s1_pktgen_tap, s2_pktgen_vhost, s7_mq_steering)
(what `NODROP_INSNPROF=1 lab/lab run <flavor> -- '... NODROP_BENCH_MARK=1
bench/run'` leaves; docs/bench.md).
Prints, for the point in both runs, the per-packet instructions of every
function whose count differs, largest difference first."""

from __future__ import annotations

import argparse
import re
import bisect
import glob
import json
import os
import struct
import statistics
from collections import defaultdict

REC = struct.Struct("<QQII")


def load_snap(path):
    data = open(path, "rb").read()
    return {(va, n): c for va, c, n, _ in REC.iter_unpack(data)}


def symbols(path):
    addrs, names = [], []
    for line in open(path):
        parts = line.split()
        if len(parts) < 3 or parts[1].lower() not in ("t", "w"):
            continue
        addrs.append(int(parts[0], 16))
        names.append(parts[2] + (f" {parts[3]}" if len(parts) > 3 else ""))
    order = sorted(range(len(addrs)), key=addrs.__getitem__)
    return [addrs[i] for i in order], [names[i] for i in order]


def windows(run, scen):
    """[(point name, packets, {function: instructions})] in bench order."""
    snaps = sorted(glob.glob(os.path.join(run, "prof.*")),
                   key=lambda p: int(p.split(".")[-2]))
    marks = [(p, p.split(".")[-1]) for p in snaps]

    def pktgen_reps(name):
        res = json.load(open(os.path.join(run, f"{name}.json")))
        return [(f"{pt['config']} threads={pt.get('threads')} {pt.get('xmit_mode')}", r)
                for pt in res["points"] for r in pt["reps"] if "pg_sent_per_s" in r]
    # one run may hold several pktgen scenarios: their windows follow the
    # run's scenario order (run.json), each rep marked once
    meta = json.load(open(os.path.join(run, "run.json")))
    order, per_point = list(meta["scenarios_elapsed_s"]), meta.get("reps", 3)
    by_scen = {n: pktgen_reps(n) for n in order}
    skip = sum(len(by_scen[n]) for n in order[:order.index(scen)])
    reps = by_scen[scen]
    pairs, s0 = [], None
    for path, label in marks:
        code = int(label)
        if code % 2 == 0:
            s0 = (path, code // 2)
        elif s0 and s0[1] == code // 2:
            # a window measured again (pktgen_reps' retry) keeps its index;
            # with one rep per point every window has index 0: no retry is
            # told apart there (one would fail the count below)
            if per_point > 1 and pairs and pairs[-1][2] == s0[1]:
                pairs.pop()
            pairs.append((s0[0], path, s0[1]))
            s0 = None
    total = sum(map(len, by_scen.values()))
    assert len(pairs) == total, f"{run}: {len(pairs)} windows, {total} pktgen reps"
    pairs = pairs[skip:skip + len(reps)]
    addrs, names = symbols(os.path.join(run, "kallsyms"))
    out = []
    for (a, b, _), (name, rep) in zip(pairs, reps):
        s0, s1 = load_snap(a), load_snap(b)
        fn = defaultdict(int)
        for (va, n), c in s1.items():
            d = (c - s0.get((va, n), 0)) * n
            if not d:
                continue
            if va < 0xffff800000000000:
                fn["[user]"] += d
                continue
            k = bisect.bisect_right(addrs, va) - 1
            fn[names[k] if k >= 0 else "?"] += d
        pkts = rep["recv_per_s"] * rep["seconds"]
        out.append((name, pkts, fn))
    return out


def per_packet(ws, point):
    sel = [(p, fn) for name, p, fn in ws if name == point]
    assert sel, f"no window of point {point!r}"
    funcs = set().union(*(fn for _, fn in sel))
    return {f: statistics.median(fn.get(f, 0) / p for p, fn in sel) for f in funcs}, len(sel)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--point", default="stock threads=1 queue_xmit")
    ap.add_argument("--scenario", default="s2_pktgen_vhost")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--match", metavar="REGEX",
                    help="also print the sum over the functions whose name matches, "
                         "e.g. tun's and vhost-net's as docs/results/flag-off-attribution "
                         "sums them: '^_*(tun|vhost|handle_rx|handle_tx|ptr_ring)'")
    o = ap.parse_args()
    a, na = per_packet(windows(o.a, o.scenario), o.point)
    b, nb = per_packet(windows(o.b, o.scenario), o.point)
    ta, tb = sum(a.values()), sum(b.values())
    print(f"point {o.point!r}: instructions per packet (icount: instructions, not cycles), "
          f"median of {na} / {nb} windows")
    print(f"total  A {ta:10.1f}  B {tb:10.1f}  B-A {tb - ta:+8.1f}  B/A {tb / ta:.4f}")
    if o.match:
        m = [f for f in set(a) | set(b) if re.search(o.match, f)]
        ma, mb = sum(a.get(f, 0) for f in m), sum(b.get(f, 0) for f in m)
        print(f"match  A {ma:10.1f}  B {mb:10.1f}  B-A {mb - ma:+8.1f}  "
              f"= {100 * (mb - ma) / ta:.2f} % of A's total ({len(m)} functions /{o.match}/)")
    rows = sorted(set(a) | set(b), key=lambda f: -abs(b.get(f, 0) - a.get(f, 0)))
    print(f"{'function':48} {'A':>9} {'B':>9} {'B-A':>8}")
    for f in rows[:o.top]:
        print(f"{f[:48]:48} {a.get(f, 0):9.1f} {b.get(f, 0):9.1f} {b.get(f, 0) - a.get(f, 0):+8.1f}")


if __name__ == "__main__":
    main()
