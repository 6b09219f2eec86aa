"""Where a pktgen point (default: s2's two-producer start_xmit point)
spends its guest time, per task, with and without BQL (same boot, order A B B A A B B A, 3 windows each; A =
bp, B = bp-nobql). Per window and task group: CPU time per delivered
packet (/proc/<pid>/task/<tid>/stat utime + stime: sum_exec_runtime split
by ticks, 10 ms resolution; under icount shift=0 a guest ns is an
instruction), voluntary switches (sleeps) per 1000 delivered packets, and
the idle time of both vCPUs. Run in the guest:
CLOCK=icount make run FLAVOR=nodrop-6.12 CMD='cd $NODROP_REPO && $NODROP_PYTHON
docs/results/bql-point-sensitivity/tasks.py > $NODROP_RESULTS/tasks.txt 2>&1'
Optional arguments: xmit mode, consumer, pktgen threads (start_xmit vhostrx 2).
An investigation, not part of make bench."""
import glob, json, os, re, statistics, subprocess, sys
sys.path.insert(0, os.path.join(os.environ["NODROP_REPO"], "bench"))
from scenarios import common as c

GROUPS = [("pktgen", re.compile(r"kpktgend_")), ("vhost worker", re.compile(r"vhost-\d+")),
          ("vhostrx", re.compile(r"vhostrx$")), ("tunreader", re.compile(r"tunreader$")),
          ("ksoftirqd", re.compile(r"ksoftirqd/")), ("other", re.compile(""))]


def tasks() -> dict:
    """CPU ns and voluntary / involuntary switches per task group, now."""
    out = {g: [0, 0, 0] for g, _ in GROUPS}
    for d in glob.glob("/proc/[0-9]*/task/[0-9]*"):
        try:
            with open(d + "/stat") as f:
                s = f.read()
            with open(d + "/status") as f:
                st = dict(x.split(":\t", 1) for x in f.read().splitlines() if ":\t" in x)
        except OSError:
            continue
        comm = s[s.index("(") + 1:s.rindex(")")]
        p = s.rsplit(")", 1)[1].split()
        ns = (int(p[11]) + int(p[12])) * 1_000_000_000 // c.USER_HZ
        g = next(g for g, r in GROUPS if r.match(comm))
        out[g][0] += ns
        out[g][1] += int(st.get("voluntary_ctxt_switches", 0))
        out[g][2] += int(st.get("nonvoluntary_ctxt_switches", 0))
    return out


orig_snap, orig_rates = c.mech_snap, c.mech_rates


def snap(dev, consumer_pid=None):
    m = orig_snap(dev, consumer_pid)
    m["tasks"] = tasks()
    return m


def rates(m0, m1, seconds=None):
    r = orig_rates(m0, m1, seconds)
    n = m1["tx_packets"] - m0["tx_packets"]
    idle = sum(b - a for a, b in zip(m0["idle_ns"], m1["idle_ns"]))
    r["task_ns_per_pkt"] = {g: (m1["tasks"][g][0] - m0["tasks"][g][0]) / n for g, _ in GROUPS}
    r["task_ns_per_pkt"]["idle (both vCPUs)"] = idle / n
    r["sleeps_per_kpkt"] = {g: 1000 * (m1["tasks"][g][1] - m0["tasks"][g][1]) / n
                            for g, _ in GROUPS}
    r["preempted_per_kpkt"] = {g: 1000 * (m1["tasks"][g][2] - m0["tasks"][g][2]) / n
                               for g, _ in GROUPS}
    return r


def install():
    """Add the per-task figures to every mech_snap() / mech_rates()."""
    c.mech_snap, c.mech_rates = snap, rates


def table(runs, names):
    """Medians over all windows per configuration, one column per name."""
    keys = [g for g, _ in GROUPS] + ["idle (both vCPUs)"]
    rows = [("guest ns per delivered packet", lambda r: r["gns_per_pkt"]),
            ("delivered pps", lambda r: r["recv_per_s"]),
            ("NET_TX per 1000 packets", lambda r: r["net_tx_per_kpkt"])]
    rows += [(f"{k}: CPU ns per packet", (lambda k: lambda r: r["task_ns_per_pkt"][k])(k))
             for k in keys]
    rows += [(f"{k}: sleeps per 1000 packets",
              (lambda k: lambda r: r["sleeps_per_kpkt"][k])(k)) for k, _ in GROUPS]
    rows += [(f"{k}: preemptions per 1000 packets",
              (lambda k: lambda r: r["preempted_per_kpkt"][k])(k)) for k, _ in GROUPS]
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, f in rows:
        vals = [statistics.median(f(r) for n, reps in runs if n == name for r in reps)
                for name in names]
        if any(vals):
            print(f"| {label} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")


def point_args(default_consumer="vhostrx"):
    """The point from the command line: xmit mode, consumer, pktgen threads."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "start_xmit"
    consumer = sys.argv[2] if len(sys.argv) > 2 else default_consumer
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    return mode, consumer, threads


def interleaved(order, config_of, mode, consumer, threads, before=None):
    """Run the point once (3 windows) per name in @order, in that order,
    in the configuration config_of(name), after before(name) if given;
    install() first. Return [(name, windows)] and print the per-name
    medians, then the table, and save the windows as JSON."""
    install()
    subprocess.run(["modprobe", "vhost_net"], capture_output=True)
    cfgs = {x["name"]: x for x in c.configs(True, bql_ok=True)}
    tools = os.environ["NODROP_TOOLS"]
    runs = []
    for name in order:
        if before:
            before(name)
        pt = c.pktgen_point(tools, cfgs[config_of(name)], threads, mode, False, 3, 1.5, 0.3,
                            consumer=consumer)
        runs.append((name, pt["reps"]))
        c.say(f"{name}: guest ns/pkt {statistics.median(r['gns_per_pkt'] for r in pt['reps']):.0f}")
    names = list(dict.fromkeys(order))
    print(f"{threads} threads {mode} {consumer}: medians over "
          f"{3 * order.count(names[0])} windows per configuration")
    table(runs, names)
    return runs


def main():
    mode, consumer, threads = point_args()
    order = ["bp", "bp-nobql", "bp-nobql", "bp"] * 2
    runs = interleaved(order, lambda name: name, mode, consumer, threads)
    path = os.path.join(os.environ["NODROP_RESULTS"], f"tasks_{threads}_{mode}_{consumer}.json")
    with open(path, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
