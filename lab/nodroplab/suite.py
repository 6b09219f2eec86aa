"""`run`, `test`, `bench`, `tools`: build + boot + run things in the guest."""

from __future__ import annotations

import concurrent.futures
import fnmatch
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .common import (REPO, RESULTS, TOOLS_OUT, LabChild, LabError, now_iso, run, say,
                     timestamp)
from .deps import lab_python
from .fetch import fetch
from .kernel import Built, kernel, tree_dir
from .matrix import Flavor, load
from . import vm
from .vm import CLOCK_OPTS, GuestResult, boot_and_run, guest_env, report_failure

# Host environment variables forwarded into the guest (on top of what the lab
# sets): every NODROP_* the lab does not set itself, the knobs below, bench
# per-scenario knobs (S<n>_...), and any name listed in NODROP_GUEST_ENV.
PASSTHROUGH = ("QUICK", "REPS", "DURATION", "SCENARIOS", "SEED", "CHAOS_WEIGHTS",
               "PYTEST_ADDOPTS")
PASSTHROUGH_RE = re.compile(r"^(NODROP_[A-Z0-9_]+|S[0-9]+_[A-Z0-9_]+)$")

SELFTEST = REPO / "lab" / "selftest"
GUEST_TESTS = REPO / "tests" / "guest"
CHAOS_TESTS = REPO / "tests" / "chaos"
# in-guest pytest suites: name -> (directory, junit file)
SUITES = {"selftest": (SELFTEST, "junit-selftest.xml"),
          "guest": (GUEST_TESTS, "junit.xml"),
          "chaos": (CHAOS_TESTS, "junit-chaos.xml")}
CHAOS_DEFAULT_S = 120      # `make test`'s chaos round; `make chaos DURATION=...`
BENCH = REPO / "bench" / "run"
BENCH_REPORT = REPO / "bench" / "report"


def timeout_s(default: float) -> float:
    return float(os.environ.get("NODROP_TIMEOUT", default))


def new_results_dir(kind: str) -> Path:
    ts = timestamp()
    d = RESULTS / ts
    n = 1
    while d.exists():
        n += 1
        d = RESULTS / f"{ts}-{n}"
    d.mkdir(parents=True)
    latest = RESULTS / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(d.name)
    except OSError:
        pass
    (d / "kind").write_text(kind + "\n")
    return d


def build_tools() -> Path | None:
    mk = REPO / "tools" / "Makefile"
    if not mk.exists():
        say("no tools/Makefile yet: skipping the tools build")
        return None
    run(["make", "-s", "-C", str(REPO / "tools"), f"OUT={TOOLS_OUT}"], quiet=False)
    return TOOLS_OUT


def passthrough_env() -> dict[str, str]:
    names = set(PASSTHROUGH) | set(os.environ.get("NODROP_GUEST_ENV", "").split())
    return {k: v for k, v in os.environ.items()
            if (k in names or PASSTHROUGH_RE.match(k))
            and k not in ("NODROP_CACHE", "NODROP_GUEST_ENV", "NODROP_KVM", "NODROP_APPEND",
                          "NODROP_JOBS")}


KSELFTEST = Path("tools/testing/selftests")
KSELFTEST_SERIES = REPO / "patches" / "linux-6.12" / "series"


def kselftest_dir() -> str:
    """tools/testing/selftests of the lab's tree with our 6.12 series (it
    holds the series' kselftest, net/tun_backpressure.c, and the harness),
    so that every flavor, ours or not, runs the same kselftest; "" until a
    flavor with that series has been built."""
    for fl in load().flavors.values():
        if fl.series == KSELFTEST_SERIES:
            d = tree_dir(fl) / KSELFTEST
            if (d / "net" / "tun_backpressure.c").is_file():
                return str(d)
    return ""


def own_kselftest_dir(fl: Flavor) -> str:
    """tools/testing/selftests of the booted flavor's own lab tree (the
    selftests its series brings), "" for a flavor without a series."""
    return str(tree_dir(fl) / KSELFTEST) if fl.series else ""


def _env_for(b: Built, rw: Path, tools: Path | None) -> dict[str, str]:
    return guest_env({**passthrough_env(),
        "NODROP_FLAVOR": b.flavor.name,
        "NODROP_RESULTS": str(rw),
        "NODROP_TOOLS": str(tools or TOOLS_OUT),
        "NODROP_REPO": str(REPO),
        "NODROP_KERNELRELEASE": b.kernelrelease,
        "NODROP_UPSTREAM_VERSION": b.upstream,
        "NODROP_SOURCE_PACKAGE": b.flavor.source.package,
        "NODROP_SOURCE_VERSION": b.flavor.source.version,
        "NODROP_SERIES_SHA256": b.series_hash,
        "NODROP_KSELFTEST_DIR": kselftest_dir(),
        "NODROP_OWN_KSELFTEST_DIR": own_kselftest_dir(b.flavor),
        **({"NODROP_FEATURES": " ".join(b.flavor.features)}
           if b.flavor.features is not None else {}),
    })


def _meta(b: Built, res: GuestResult | None, extra: dict | None = None) -> dict:
    fl = b.flavor
    m = {
        "flavor": fl.name,
        "description": fl.description,
        "source": {"package": fl.source.package, "version": fl.source.version,
                   "suite": fl.source.suite, "deb_sha256": fl.source.sha256,
                   "upstream_version": b.upstream},
        "series": {"file": str(fl.series.relative_to(REPO)) if fl.series else None,
                   "sha256": b.series_hash, "patches": b.patches},
        "config": {"fragments": [str(f.relative_to(REPO)) for f in fl.fragments],
                   "hash": b.config_hash, "localversion": fl.localversion},
        "kernelrelease_built": b.kernelrelease,
        "bzimage": str(b.bzimage),
        "build_dir": str(b.build_dir),
        "build": {"reused": b.reused, "seconds": b.build_seconds},
        "host": {"kernel": platform.release(), "python": lab_python(), **_host_cpu()},
        "repo": _repo_state(),
        "finished": now_iso(),
    }
    if res is not None:
        m["guest"] = {"uname_r": res.uname, "rc": res.rc, "booted": res.booted,
                      "kvm": res.kvm, "boot_seconds": _r(res.boot_seconds),
                      "guest_uptime_at_start": res.guest_uptime,
                      "wall_seconds": _r(res.wall_seconds), "timed_out": res.timed_out}
    m.update(extra or {})
    return m


def _host_cpu() -> dict:
    """The host's CPU as /proc/cpuinfo names it (vendor, family/model/stepping,
    model name, MHz) and its count: timings are compared across machines "of
    this kind", which the kernel release alone does not tell apart."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        first = ""
    f = {k.strip(): v.strip() for k, _, v in
         (ln.partition(":") for ln in first.splitlines())}
    cpu = (f"{f.get('vendor_id', '?')} {f.get('cpu family', '?')}/{f.get('model', '?')}/"
           f"{f.get('stepping', '?')} {f.get('model name', '?')} {f.get('cpu MHz', '?')} MHz")
    return {"cpu": cpu, "cpus": os.cpu_count()}


def _repo_state() -> dict:
    """The checkout a result came from: commit, and whether what is measured
    (patches, lab, bench, tests, tools) differed from it (a figure names the
    commit it was measured at; docs edits do not count)."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                           check=False)
        return r.stdout.strip() if r.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--",
                              "patches", "lab", "bench", "tests", "tools"))}


def _r(x):
    return None if x is None else round(x, 2)


def _write_meta(rw: Path, meta: dict) -> None:
    (rw / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


# --- run ------------------------------------------------------------------------

def cmd_run(fl: Flavor, command: str) -> int:
    try:
        tools = build_tools()
    except LabError as e:
        say(f"warning: tools build failed, continuing: {e}")
        tools = None
    b = kernel(fl)
    rw = new_results_dir("run") / fl.name
    rw.mkdir()
    clock = os.environ.get("CLOCK", "wall").strip() or "wall"   # `make run` default: wall
    env = dict(_env_for(b, rw, tools), NODROP_CLOCK=clock)
    res = boot_and_run(b.bzimage, command, rw, env=env, cwd=Path.cwd(),
                       timeout=timeout_s(3600), clock=clock)
    _write_meta(rw, _meta(b, res, {"command": command, "clock": clock}))
    if res.rc is None:
        raise LabError(report_failure(res, f"{fl.name}: run"))
    say(f"{fl.name}: {res.uname}: exit {res.rc} (results: {rw})")
    return res.rc


# --- test -----------------------------------------------------------------------

def _junit_counts(path: Path) -> tuple[int, int, int, list[str], list[dict]]:
    """passed, failed, skipped, failed test names, and per failed or skipped
    test {"test", "outcome" (failed / skipped / xfailed), "message"}."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return 0, 0, 0, [], []
    p = f = s = 0
    failed, details = [], []
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        bad = tc.find("failure")
        if bad is None:
            bad = tc.find("error")
        skip = tc.find("skipped")
        if bad is not None:
            f += 1
            failed.append(name)
            details.append({"test": name, "outcome": "failed",
                            "message": bad.get("message") or (bad.text or "")})
        elif skip is not None:
            s += 1
            details.append({"test": name, "outcome": "xfailed"
                            if skip.get("type") == "pytest.xfail" else "skipped",
                            "message": skip.get("message") or (skip.text or "")})
        else:
            p += 1
    return p, f, s, failed, details


def _test_command(py: str, rw: Path, suites: list[str],
                  select: list[str] | None = None) -> str:
    """select: pytest node ids under tests/guest ("test_x.py::test_y") to run
    instead of the whole guest suite."""
    q = shlex.quote
    lines = [f"cd {q(str(REPO))}"]
    for name in suites:
        d, junit = SUITES[name]
        rel = str(d.relative_to(REPO))
        what = " ".join(q(f"{rel}/{n}") for n in select) if select and name == "guest" \
            else q(rel)
        lines += [
            f"{q(py)} -m pytest {what} -p no:cacheprovider -v "
            f"--junitxml={q(str(rw / junit))}",
            f"echo $? > {q(str(rw / '.nodrop' / ('rc-' + name)))}",
        ]
    return "\n".join(lines)


def _suite_result(rw: Path, name: str, junit: str) -> dict:
    rc_file = rw / ".nodrop" / f"rc-{name}"
    try:
        rc = int(rc_file.read_text().strip())
    except (OSError, ValueError):
        rc = None
    p, f, s, failed, details = _junit_counts(rw / junit)
    notes = []
    if rc is None:
        notes.append(f"{name}: pytest did not finish")
        f += 1
    elif rc == 5:
        notes.append(f"{name}: no tests collected")
    elif rc not in (0, 1) or (rc == 1 and f == 0):
        notes.append(f"{name}: pytest exit {rc}")
        f += 1
    return {"rc": rc, "passed": p, "failed": f, "skipped": s, "failed_tests": failed,
            "details": details, "notes": notes}


def cmd_test(flavors: list[Flavor], chaos: list[Flavor], package=None,
             model: bool = True) -> int:
    """The guest suite on each flavor, a short chaos round on each chaos
    flavor, and the LKMM model row. package: the nodrop-dkms rows
    (pkgtest.PackageTests), prepared in the background from the start,
    booted after the kernel flavors' rows."""
    rows, tools = _tools_row()
    out = new_results_dir("test")
    say(f"results: {out}")
    ahead: LabChild | None = None
    later = list(dict.fromkeys(f.name for f in flavors[1:] + chaos))

    def build_ahead(b: Built) -> None:
        # once a kernel is built, the later rows' ones (niced) while guests
        # run: a TCG guest keeps about one of the two cores busy
        nonlocal ahead
        if later and ahead is None:
            log = out / "prebuild.log"
            say(f"building {', '.join(later)} in the background, niced (log: {log})")
            ahead = LabChild(["prebuild", *later], log, nice=10)
    try:
        if package is not None:
            package.start(out)
        if model:
            rows.append(_model_row(out))
        for fl in flavors:
            rows.append(_suites_row(fl, ["selftest", "guest"], out / fl.name, tools, {},
                                    built=build_ahead))
        if package is not None:
            rows += package.rows()
        for fl in chaos:
            dur = os.environ.get("DURATION") or str(CHAOS_DEFAULT_S)
            rows.append(_suites_row(fl, ["chaos"], out / f"{fl.name}-chaos", tools,
                                    {"DURATION": dur}, label=f"{fl.name} (chaos {dur}s)"))
    finally:
        if ahead is not None:
            ahead.stop()
        if package is not None:
            package.stop()
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    return _print_table(rows, out)


def cmd_chaos(flavors: list[Flavor]) -> int:
    """`make chaos`: the chaos round alone, DURATION seconds per flavor."""
    rows, tools = _tools_row()
    out = new_results_dir("chaos")
    say(f"results: {out}")
    dur = os.environ.get("DURATION") or str(CHAOS_DEFAULT_S)
    for fl in flavors:
        rows.append(_suites_row(fl, ["chaos"], out / fl.name, tools, {"DURATION": dur},
                                label=f"{fl.name} (chaos {dur}s)"))
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    return _print_table(rows, out)


def _tools_row() -> tuple[list[dict], Path | None]:
    try:
        return [], build_tools()
    except LabError as e:
        say(f"error: tools build failed (the suites run anyway): {e}")
        return [{"flavor": "(tools)", "kernel": "-", "passed": 0, "failed": 1, "skipped": 0,
                 "status": "build failed", "notes": ["make -C tools failed"]}], None


def _suites_row(fl: Flavor, suites: list[str], rw: Path, tools: Path | None,
                env: dict[str, str], label: str | None = None, built=None,
                b: Built | None = None, select: list[str] | None = None) -> dict:
    """Build fl (or take the kernel b), boot it, run the named in-guest pytest
    suites (select: only these guest tests); one table row.
    built: called with the Built kernel before it boots."""
    row = {"flavor": label or fl.name, "kernel": "-", "passed": 0, "failed": 0, "skipped": 0,
           "status": "ok", "notes": []}
    rw.mkdir()
    try:
        b = b or kernel(fl)
    except LabError as e:
        say(f"error: {e}")
        row.update(status="build failed", failed=1, notes=[str(e).splitlines()[0]])
        (rw / "meta.json").write_text(json.dumps({"flavor": fl.name, "error": str(e)},
                                                 indent=2) + "\n")
        return row
    say(f"=== {row['flavor']}: {b.kernelrelease} ({b.flavor.source.package} "
        f"{b.flavor.source.version}, series {b.series_hash[:12]}) ===")
    if built is not None:
        built(b)
    suites = [s for s in suites if SUITES[s][0].is_dir()]
    limit = timeout_s(max(3600.0, float(env.get("DURATION", 0)) + 1800))
    # a sanitizer kernel boots about 3x slower; next to other guests on the
    # 2 cores one took more than 300 s to start the command (docs/chaos.md)
    debug = any(f.name == "debug.config" for f in b.flavor.fragments)
    res = boot_and_run(b.bzimage, _test_command(lab_python(), rw, suites, select), rw,
                       env={**_env_for(b, rw, tools), **env}, cwd=REPO, timeout=limit,
                       boot_timeout=600 if debug else 300)
    row["kernel"] = res.uname or "-"
    results = {s: _suite_result(rw, s, SUITES[s][1]) for s in suites}
    for r in results.values():
        for k in ("passed", "failed", "skipped"):
            row[k] += r[k]
        row["notes"] += r["notes"]
    details = [d for r in results.values() for d in r["details"]]
    _count_known_failures(fl, row, details)
    _check_skips(fl.features, fl.allowed_skips, row, details)
    if res.rc is None:
        row["status"] = "boot failed" if not res.booted else "guest died"
        row["failed"] = max(row["failed"], 1)
        say(report_failure(res, fl.name))
    elif row["failed"]:
        row["status"] = "failed"
    _write_meta(rw, _meta(b, res, {"suites": results}))
    return row


def _is_test(junit_name: str, entry: str) -> bool:
    """junit's "<dotted module>::<test>[param]" matches flavors.toml's
    "test_x.py::<test glob>" (fnmatch on the test part, parameters included)."""
    module, _, test = junit_name.partition("::")
    emod, _, etest = entry.partition("::")
    return (module.rsplit(".", 1)[-1] == emod.removesuffix(".py")
            and fnmatch.fnmatchcase(test, etest))


def _count_known_failures(fl: Flavor, row: dict, details: list[dict]) -> None:
    """A failure the flavor lists in known_failures (a defect measured on that
    kernel, e.g. mainline's in test_defects.py) whose message matches the
    entry's regex is counted as "known", not as failed: the run stays
    meaningful (red only on the unexpected) while the test stays strict. The
    same test failing for another reason is a failure; a listed defect that
    did not fail is noted."""
    known, hit = [], set()
    for d in details:
        if d["outcome"] != "failed":
            continue
        for i, (test, msg) in enumerate(fl.known_failures):
            if _is_test(d["test"], test) and re.search(msg, d["message"]):
                known.append(d["test"])
                hit.add(i)
                break
    row["known"] = len(known)
    row["failed"] -= len(known)
    if known:
        row["notes"].append(f"known defects reproduced: {', '.join(known)}")
    missing = [t for i, (t, _) in enumerate(fl.known_failures) if i not in hit]
    if missing:
        row["notes"].append(f"known defects not reproduced: {', '.join(missing)}")


LACKS = re.compile(r"\[lacks ([a-z0-9-]+)\]")


def _check_skips(features: tuple[str, ...] | None, allowed_skips: tuple[tuple[str, str], ...],
                 row: dict, details: list[dict]) -> None:
    """Every skip and xfail must be one the row allows: tagged
    "[lacks <feature>]" (tunlib.lacks) for a feature it does not declare, or
    matching an allowed_skips entry. Anything else counts as a failure of
    the row: a kernel that lost a feature must not pass by skipping."""
    if features is None:
        row["notes"].append("skips not checked: the flavor declares no features")
        return
    bad = []
    for d in details:
        if d["outcome"] == "failed":
            continue
        m = LACKS.search(d["message"])
        if m and m.group(1) not in features:
            continue
        if any(_is_test(d["test"], t) and re.search(r, d["message"])
               for t, r in allowed_skips):
            continue
        bad.append(f"{d['test']} ({d['outcome']}: {d['message'][:120]})")
    if bad:
        row["failed"] += len(bad)
        row["notes"].append(f"unexpected skips/xfails: {'; '.join(bad)}")


def _model_row(out: Path) -> dict:
    """The LKMM litmus tests of the stop/wake protocol (model/run, host side,
    herd7 against the pinned 6.12 tools/memory-model): one row of the table."""
    row = {"flavor": "(model)", "kernel": "LKMM", "passed": 0, "failed": 0, "skipped": 0,
           "status": "ok", "notes": []}
    runner = REPO / "model" / "run"
    if not os.access(runner, os.X_OK):
        row["notes"].append("no model/run")
        return row
    say("=== model: LKMM litmus tests (model/run) ===")
    try:    # tools/memory-model of the kernel the series is for
        ksrc = fetch(load().flavor("nodrop-6.12").source)
    except LabError as e:
        row.update(status="failed", failed=1, notes=[str(e).splitlines()[0]])
        return row
    env = dict(os.environ, NODROP_KSRC=str(ksrc))
    p = subprocess.run([str(runner)], cwd=REPO, env=env, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    (out / "model.log").write_text(p.stdout + p.stderr)
    print(p.stdout, end="", flush=True)
    m = re.search(r"^(\d+) passed, (\d+) failed", p.stdout, re.M)
    if m:
        row["passed"], row["failed"] = int(m.group(1)), int(m.group(2))
    if p.returncode != 0:
        row["status"] = "failed"
        row["failed"] = max(row["failed"], 1)
        row["notes"].append((p.stderr.strip().splitlines() or ["model/run failed"])[-1])
    return row


def _print_table(rows: list[dict], out: Path) -> int:
    w = max([len(r["flavor"]) for r in rows] + [6])
    k = max([len(r["kernel"]) for r in rows] + [6])
    print()
    print(f"{'flavor':<{w}}  {'kernel':<{k}}  {'passed':>6}  {'failed':>6}  {'skipped':>7}  status")
    for r in rows:
        print(f"{r['flavor']:<{w}}  {r['kernel']:<{k}}  {r['passed']:>6}  {r['failed']:>6}  "
              f"{r['skipped']:>7}  {r['status']}" + (f"  ({'; '.join(r['notes'])})"
                                                    if r["notes"] else ""))
    print(f"results: {out}")
    tp = sum(r["passed"] for r in rows)
    tf = sum(r["failed"] for r in rows)
    ts = sum(r["skipped"] for r in rows)
    tk = sum(r.get("known", 0) for r in rows)
    print(f"{tp} passed, {tf} failed, {ts} skipped"
          + (f", {tk} known defects reproduced (failed as expected)" if tk else ""), flush=True)
    return 1 if tf or any(r["status"] != "ok" for r in rows) else 0


# --- bench ----------------------------------------------------------------------

def bench_clock() -> str:
    """CLOCK=icount (default for benchmarks) or CLOCK=wall; docs/bench.md."""
    return os.environ.get("CLOCK", "icount").strip() or "icount"


def bench_boots() -> int:
    """BOOTS: boots of every flavor (the report's unit of repetition;
    docs/bench.md), default 3, QUICK 1."""
    quick = os.environ.get("QUICK", "") not in ("", "0")
    v = os.environ.get("BOOTS", "").strip() or ("1" if quick else "3")
    if not v.isdigit() or int(v) < 1:
        raise LabError(f"BOOTS={v}: a number of boots, at least 1", rc=2)
    return int(v)


def bench_jobs(clock: str) -> int:
    """GUESTS: bench guests booted at the same time. Under icount a guest's
    figures count instructions and do not move with host load (docs/bench.md,
    "Clock"), and QEMU runs an icount guest in one host thread: default one
    guest per host core, at most 2. Under CLOCK=wall guests would measure
    each other: 1, and GUESTS>1 is refused."""
    v = os.environ.get("GUESTS", "").strip()
    if not v:
        return 1 if clock == "wall" else max(1, min(2, os.cpu_count() or 1))
    if not v.isdigit() or int(v) < 1:
        raise LabError(f"GUESTS={v}: a number of guests booted at once, at least 1", rc=2)
    if clock == "wall" and int(v) > 1:
        raise LabError(f"GUESTS={v} with CLOCK=wall: guests on a wall clock would measure "
                       "each other's load; GUESTS>1 needs CLOCK=icount", rc=2)
    return int(v)


class _HostRecord:
    """host.json of a bench run: when its boots ran, how many guests at a
    time, and the host's 1-minute load average sampled every minute beside
    them (bench/report prints it under "Run time"). A RESUME adds a part."""

    def __init__(self, path: Path, guests: int) -> None:
        self.path = path
        try:
            self.parts = json.loads(path.read_text()).get("parts", [])
        except (OSError, ValueError):
            self.parts = []
        self.part = {"started": now_iso(), "guests": guests, "cpus": os.cpu_count(),
                     "load1": []}
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while True:
            try:
                self.part["load1"].append(float(Path("/proc/loadavg").read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
            if self.stop.wait(60):
                return

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.part.update(ended=now_iso(), wall_seconds=round(time.monotonic() - self.t0, 1))
        self.path.write_text(json.dumps({"parts": [*self.parts, self.part]}, indent=1) + "\n")


def _bench_resume_dir() -> Path | None:
    """RESUME=<results dir of an interrupted make bench>: finish that run."""
    v = os.environ.get("RESUME", "").strip()
    if not v:
        return None
    d = Path(v) if os.path.isabs(v) else (REPO / v)
    if not (d / "kind").is_file() or (d / "kind").read_text().strip() != "bench":
        raise LabError(f"RESUME={v}: not the results directory of a make bench run", rc=2)
    return d


def _boot_meta(rw: Path) -> dict | None:
    try:
        return json.loads((rw / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _same_kernel(m: dict, b: Built) -> bool:
    return (m.get("series", {}).get("sha256"), m.get("config", {}).get("hash")) == \
        (b.series_hash, b.config_hash)


def _bench_resume_flavor(out: Path, b: Built) -> None:
    """One run measures one kernel per flavor: if a flavor's series or config
    changed since its first boots, all its boots run again."""
    d = out / b.flavor.name
    old = [m for rw in sorted(d.glob("boot-*")) if (m := _boot_meta(rw)) is not None]
    if any(not _same_kernel(m, b) for m in old):
        say(f"{b.flavor.name}: its kernel changed since the interrupted run "
            f"(series {b.series_hash[:12]} now): all its boots run again")
        shutil.rmtree(d, ignore_errors=True)


def _boot_done(rw: Path) -> dict | None:
    """The meta.json of boot directory rw if it holds a complete boot (an
    interrupted run's boot is redone; _bench_resume_flavor() removed the
    boots of another kernel)."""
    m = _boot_meta(rw)
    if m is None:
        return None
    done = m.get("guest", {}).get("rc") == 0 and (rw / "run.json").is_file()
    return m if done else None


def cmd_bench(flavors: list[Flavor]) -> int:
    """Build every flavor, then boot them in turns (A B C A B C ...), each
    boot running bench/run into <results>/<flavor>/boot-<n>/, and
    bench/report over all of them. RESUME=<that results dir> finishes an
    interrupted run: complete boots are kept, the others are run again, and
    every boot of a flavor whose kernel changed since."""
    clock = bench_clock()
    if clock not in CLOCK_OPTS:
        raise LabError(f"CLOCK={clock}: valid clocks are {', '.join(CLOCK_OPTS)}", rc=2)
    boots = bench_boots()
    say(f"guest clock: {clock}" + (" (QEMU " + " ".join(CLOCK_OPTS[clock]) + ")"
                                    if CLOCK_OPTS[clock] else "")
        + f"; {boots} boot(s) per flavor, interleaved")
    tools = build_tools()
    knobs = {"clock": clock, "boots": boots, "env": passthrough_env(),
             "flavors": [fl.name for fl in flavors]}
    out = _bench_resume_dir()
    resuming = out is not None
    if out is None:
        out = new_results_dir("bench")
        (out / "knobs.json").write_text(json.dumps(knobs, indent=2) + "\n")
    else:
        try:
            was = json.loads((out / "knobs.json").read_text())
        except (OSError, ValueError):
            raise LabError(f"RESUME: {out} has no knobs.json (a run from before RESUME "
                           "existed); start a new run instead", rc=2) from None
        if was != knobs:
            raise LabError(f"RESUME: {out} ran with {json.dumps(was)}; this command has "
                           f"{json.dumps(knobs)}: give the same flavors and knobs", rc=2)
        say(f"resuming {out}")
    rows = []
    built = []
    bad = False
    for fl in flavors:
        row = {"flavor": fl.name, "uname": "-", "package": f"{fl.source.package} "
               f"{fl.source.version}", "series": "-", "boot": "-", "bench": "-",
               "boots": []}
        rows.append(row)
        try:
            b = kernel(fl)
        except LabError as e:
            say(f"error: {e}")
            row["bench"] = "build failed"
            bad = True
            continue
        row["series"] = b.series_hash[:12]
        built.append((fl, b, row))
    # Extension point: an executable bench/run (owned by the benchmark work)
    # runs in the guest from the repo root; it writes into $NODROP_BENCH_OUT.
    cmd = (f"if [ -x {shlex.quote(str(BENCH))} ]; then {shlex.quote(str(BENCH))}; "
           f"else echo 'no bench/run yet: kernel matrix only'; uname -a; fi")
    if resuming:
        for _fl, b, _row in built:
            _bench_resume_flavor(out, b)
    jobs = bench_jobs(clock)
    if jobs > 1:
        say(f"{jobs} guests at a time (GUESTS={jobs}; icount: their figures do not move "
            "with host load, docs/bench.md)")
    # the boots in their interleaved order (A B C A B C ...); a boot that
    # RESUME finds complete is counted and skipped
    todo = []
    for n in range(1, boots + 1):
        for fl, b, row in built:
            rw = out / fl.name / f"boot-{n}"
            if (done := _boot_done(rw)) is not None:
                say(f"{fl.name}: boot {n} of {boots} done before (RESUME)")
                row["uname"] = done["guest"].get("uname_r") or row["uname"]
                row["boots"].append((n, "ok"))
                continue
            todo.append((n, fl, b, row, rw))
    lock = threading.Lock()

    def one_boot(n: int, fl: Flavor, b: Built, row: dict, rw: Path) -> bool:
        shutil.rmtree(rw, ignore_errors=True)
        rw.mkdir(parents=True)
        say(f"{fl.name}: boot {n} of {boots}")
        env = _env_for(b, rw, tools)
        env.update(NODROP_BENCH_OUT=str(rw), NODROP_CLOCK=clock, NODROP_BOOT=str(n))
        res = boot_and_run(b.bzimage, cmd, rw, env=env, cwd=REPO, timeout=timeout_s(7200),
                           clock=clock, relay=jobs == 1)
        if res.rc is None:
            verdict = "boot failed" if not res.booted else "guest died"
            say(report_failure(res, f"{fl.name} boot {n}"))
        else:
            verdict = "ok" if res.rc == 0 else f"exit {res.rc}"
            if jobs > 1:
                say(f"{fl.name}: boot {n} of {boots}: {verdict} (guest output: {rw}/stdout)")
        _write_meta(rw, _meta(b, res, {"command": cmd, "clock": clock, "boot": n,
                                       "boots": boots,
                                       "qemu_clock_opts": " ".join(CLOCK_OPTS[clock])}))
        with lock:
            row["uname"] = res.uname or row["uname"]
            if res.boot_seconds:
                row["boot_s"].append((n, res.boot_seconds))
            row["boots"].append((n, verdict))
        return verdict == "ok"

    for _fl, _b, row in built:
        row["boot_s"] = []
    host = _HostRecord(out / "host.json", jobs)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    try:
        results = list(pool.map(lambda t: one_boot(*t), todo))
    except BaseException:
        # interrupted (SIGTERM/^C reach the main thread only): the guests of
        # the worker threads stop too
        vm.ABORT.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown()
        host.close()
    bad |= not all(results)
    for _fl, _b, row in built:
        verdicts = [v for _n, v in sorted(row["boots"])]
        secs = [f"{s:.1f}s" for _n, s in sorted(row.pop("boot_s"))]
        row["boot"] = " ".join(secs) or "-"
        row["boots"] = verdicts
        row["bench"] = f"ok {verdicts.count('ok')}/{len(verdicts)}" + \
            "".join(f", boot {i + 1}: {x}" for i, x in enumerate(verdicts) if x != "ok") + \
            ("" if BENCH.exists() else " (no bench/run)")
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    if os.access(BENCH_REPORT, os.X_OK):
        dirs = [str(out / r["flavor"]) for r in rows
                if any(x == "ok" or x.startswith("exit") for x in r["boots"])]
        if dirs:
            knobs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(passthrough_env().items()))
            knobs = f"CLOCK={clock} BOOTS={boots}" + (f" {knobs}" if knobs else "")
            again = f"{knobs} make bench FLAVORS='{' '.join(r['flavor'] for r in rows)}'"
            r = run([sys.executable, str(BENCH_REPORT), "--out", str(out), "--cmd", again, *dirs],
                    check=False)
            if r.returncode != 0:
                say(f"bench/report failed (exit {r.returncode})")
                bad = True
    cols = [("flavor", "flavor"), ("uname -r", "uname"), ("source package", "package"),
            ("series sha256", "series"), ("boot", "boot"), ("bench", "bench")]
    widths = [max(len(h), *(len(r[key]) for r in rows)) for h, key in cols]
    print()
    print("  ".join(h.ljust(wd) for (h, _), wd in zip(cols, widths)))
    for r in rows:
        print("  ".join(r[key].ljust(wd) for (_, key), wd in zip(cols, widths)))
    print(f"results: {out}")
    return 1 if bad else 0
