"""Instruction profile (perf cpu-clock under icount) of s2's 2-thread
start_xmit point, with and without BQL (same boot). Run in the guest:
CLOCK=icount make run FLAVOR=nodrop-6.12 CMD='cd $NODROP_REPO && $NODROP_PYTHON
docs/results/bql-s2-start-xmit/profile_s2.py > $NODROP_RESULTS/prof.txt 2>&1'
(NOPERF=1: only the points, e.g. on a kernel with the counting patch).
Needs `perf` (Debian's linux-perf) on the host, whose / the guest shares:
not a lab dependency, this is an investigation, not part of make bench."""
import os, signal, subprocess, sys, time
sys.path.insert(0, os.path.join(os.environ["NODROP_REPO"], "bench"))
from scenarios import common as c

out = os.environ["NODROP_RESULTS"]
orig = c.pktgen_reps
state = {}

def wrapped(*a, **kw):
    name = state["name"]
    p = subprocess.Popen(["perf", "record", "-a", "-e", "cpu-clock", "-F", "5000",
                          "-o", f"{out}/perf.{name}.data"],
                         stdout=subprocess.DEVNULL, stderr=open(f"{out}/perf.{name}.err", "w"))
    time.sleep(0.5)
    try:
        return orig(*a, **kw)
    finally:
        p.send_signal(signal.SIGINT)
        p.wait()

if not os.environ.get("NOPERF"):
    c.pktgen_reps = wrapped
tools = os.environ["NODROP_TOOLS"]
mode = sys.argv[1] if len(sys.argv) > 1 else "start_xmit"
consumer = sys.argv[2] if len(sys.argv) > 2 else "vhostrx"
subprocess.run(["modprobe", "vhost_net"], capture_output=True)
for cfg in c.configs(True, bql_ok=True)[1:]:
    state["name"] = f"{cfg['name']}-{mode}-{consumer}"
    pt = c.pktgen_point(tools, cfg, 2, mode, False, 3, 1.5, 0.3, consumer=consumer)
    c.say_pktgen(state["name"], pt)
    subprocess.run(f"dmesg | grep tundbg | tail -3 > {out}/dbg.{state['name']}.txt", shell=True)
    if os.environ.get("NOPERF"):
        continue
    with open(f"{out}/report.{state['name']}.txt", "w") as f:
        subprocess.run(["perf", "report", "-i", f"{out}/perf.{state['name']}.data", "--stdio",
                        "--sort", "sym", "--percent-limit", "0.3"], stdout=f,
                       stderr=subprocess.STDOUT)
