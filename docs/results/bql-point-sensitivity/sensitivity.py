"""How sensitive a two-producer pktgen point is to a few guest instructions
more per ring take or per produce, without BQL: is BQL's cost there its own,
or any work of its size amplified by the point? Arguments: xmit mode,
consumer and pktgen threads (default start_xmit vhostrx 2, s2's point;
start_xmit tunreader 2 is s1's). Needs an experiment kernel with tun's take_spin / produce_spin
parameters (experiment-spin-6.12.patch / experiment-spin-7.3.patch here,
not part of any series, built as a temporary lab flavor: a `cpu_relax()`
loop, 3 guest instructions per iteration, at the start of every take from
the ring and under the producer_lock of every produce). Order A B C D D C
B A, twice, 3 windows each. Run in the guest:
CLOCK=icount make run FLAVOR=<experiment flavor> CMD='cd $NODROP_REPO &&
$NODROP_PYTHON docs/results/bql-point-sensitivity/sensitivity.py [mode consumer]
> $NODROP_RESULTS/sens.txt 2>&1'
An investigation, not part of make bench."""
import json, os, statistics, subprocess, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks as t
from tasks import c

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


t.install()
tools = os.environ["NODROP_TOOLS"]
mode = sys.argv[1] if len(sys.argv) > 1 else "start_xmit"
consumer = sys.argv[2] if len(sys.argv) > 2 else "vhostrx"
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
subprocess.run(["modprobe", "vhost_net"], capture_output=True)
cfgs = {x["name"]: x for x in c.configs(True, bql_ok=True)}
names = list(VARIANTS)
runs = []
for name in (names + names[::-1]) * 2:
    cfg, take, produce = VARIANTS[name]
    knobs(take, produce)
    pt = c.pktgen_point(tools, cfgs[cfg], threads, mode, False, 3, 1.5, 0.3, consumer=consumer)
    runs.append((name, pt["reps"]))
    c.say(f"{name}: guest ns/pkt {statistics.median(r['gns_per_pkt'] for r in pt['reps']):.0f}")
knobs(0, 0)
print(f"{threads} threads {mode} {consumer}: medians over 12 windows per variant")
t.table(runs, names)
base = [statistics.median(r["gns_per_pkt"] for r in reps) for n, reps in runs if n == names[0]]
for name in names[1:]:
    v = [statistics.median(r["gns_per_pkt"] for r in reps) for n, reps in runs if n == name]
    print(f"{name} / A: {statistics.median(v) / statistics.median(base):.3f} "
          f"(runs {', '.join(f'{x:.0f}' for x in v)}; A {', '.join(f'{x:.0f}' for x in base)})")
with open(os.path.join(os.environ["NODROP_RESULTS"], f"sensitivity_{threads}_{mode}_{consumer}.json"), "w") as f:
    json.dump(runs, f, indent=1)
