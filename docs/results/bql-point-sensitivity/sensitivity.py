"""How sensitive a pktgen point is to a few guest instructions more per
ring take or per produce, without BQL: is BQL's cost there its own, or any
work of its size amplified by the point? Arguments: xmit mode, consumer
and pktgen threads (default start_xmit vhostrx 2, s2's point; start_xmit
tunreader 2 is s1's). Needs an experiment kernel with tun's take_spin /
produce_spin parameters (experiment-spin-6.12.patch /
experiment-spin-7.3.patch here, not part of any series, built as a
temporary lab flavor: a `cpu_relax()` loop, 3 guest instructions per
iteration, at the start of every take from the ring and under the
producer_lock of every produce). Order A B C D D C B A, twice, 3 windows
each. Run in the guest:
CLOCK=icount make run FLAVOR=<experiment flavor> CMD='cd $NODROP_REPO &&
$NODROP_PYTHON docs/results/bql-point-sensitivity/sensitivity.py
[mode consumer threads] > $NODROP_RESULTS/sens.txt 2>&1'
An investigation, not part of make bench."""
import json, os, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks as t

PARAMS = "/sys/module/tun/parameters/"
TAKE, PRODUCE = int(os.environ.get("TAKE_SPIN", "10")), int(os.environ.get("PRODUCE_SPIN", "8"))
VARIANTS = {  # name: (config, take_spin, produce_spin)
    "A bp-nobql": ("bp-nobql", 0, 0),
    f"B bp-nobql take+{TAKE}": ("bp-nobql", TAKE, 0),
    f"C bp-nobql produce+{PRODUCE}": ("bp-nobql", 0, PRODUCE),
    "D bp": ("bp", 0, 0),
}


def knobs(take, produce):
    for name, v in (("take_spin", take), ("produce_spin", produce)):
        with open(PARAMS + name, "w") as f:
            f.write(str(v))


mode, consumer, threads = t.point_args()
order = (list(VARIANTS) + list(VARIANTS)[::-1]) * 2
runs = t.interleaved(order, lambda name: VARIANTS[name][0], mode, consumer, threads,
                     before=lambda name: knobs(*VARIANTS[name][1:]))
knobs(0, 0)
names = list(VARIANTS)
base = [statistics.median(r["gns_per_pkt"] for r in reps) for n, reps in runs if n == names[0]]
for name in names[1:]:
    v = [statistics.median(r["gns_per_pkt"] for r in reps) for n, reps in runs if n == name]
    print(f"{name} / A: {statistics.median(v) / statistics.median(base):.3f} "
          f"(runs {', '.join(f'{x:.0f}' for x in v)}; A {', '.join(f'{x:.0f}' for x in base)})")
path = os.path.join(os.environ["NODROP_RESULTS"], f"sensitivity_{threads}_{mode}_{consumer}.json")
with open(path, "w") as f:
    json.dump(runs, f, indent=1)
