"""`mutants`: break the series on purpose and check that the tests notice.

tests/mutants/<series dir>.toml lists source mutants of a flavor's series:
each replaces one exact snippet of one file (it must occur exactly once in
the patched tree, or the mutant is stale and the run fails) and names the
guest tests that claim to guard that code. Per mutant the lab builds the
kernel from a git worktree of the flavor's tree with the snippet replaced
(same compile paths as every flavor, so ccache rebuilds only the files the
mutant touches), boots it and runs those tests with the flavor's declared
features: a failure, an unexpected skip, a crash or a hang kills the
mutant; all passing means it survived.

A mutant with `model = "<test>.litmus <barrier>"` removes a barrier. On
x86 a removed smp_mb__after_atomic() changes no instruction and a removed
smp_mb() opens a window a test under TCG hits too rarely to decide, so such
a mutant is killed by the LKMM instead: `model/run --mutants` must find the
lost wake-up that barrier prevents (verdict Sometimes) in the litmus test
that models that code. It is not built. `model = "<test>.litmus"` names a
litmus test that models the code without the mutated lines (e.g. the
producer's re-check after its stop) and must reach the bad outcome.

The target prints "N killed, N survived" and exits 1 if any mutant survived,
is stale, or did not build (docs/tests.md, "Mutants").
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .common import REPO, LabError, cache_dir, safe, say
from .kernel import (Built, _git, _make, build_lock, configure, kernel, tree_dir)
from .matrix import Flavor, Matrix
from .suite import _suites_row, _tools_row, new_results_dir

MUTANTS_DIR = REPO / "tests" / "mutants"


@dataclass(frozen=True)
class Mutant:
    name: str
    patch: str           # the series patch whose code it breaks
    why: str             # what the mutant removes, in a sentence
    file: str = ""
    find: str = ""
    replace: str = ""
    tests: tuple[str, ...] = ()
    model: str = ""      # "<test>.litmus <barrier>": killed by the LKMM


def load_mutants(mx: Matrix) -> tuple[Flavor, list[Mutant]]:
    path = MUTANTS_DIR / "linux-6.12.toml"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LabError(f"cannot read {path}: {e}")
    fl = mx.flavor(data["flavor"])
    out = []
    for m in data.get("mutant", []):
        try:
            mu = Mutant(name=m["name"], patch=m["patch"], why=m["why"],
                        file=m.get("file", ""), find=m.get("find", ""),
                        replace=m.get("replace", ""), tests=tuple(m.get("tests", ())),
                        model=m.get("model", ""))
        except KeyError as e:
            raise LabError(f"{path}: mutant {m.get('name', '?')}: missing key {e}")
        if not mu.model and not (mu.file and mu.find and mu.tests):
            raise LabError(f"{path}: mutant {mu.name}: needs file, find and tests "
                           f"(or model)")
        out.append(mu)
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise LabError(f"{path}: duplicate mutant names")
    return fl, out


def _worktree(fl: Flavor) -> Path:
    """A git worktree of the flavor's tree at its series head."""
    tree = tree_dir(fl)
    wt = tree.with_name(tree.name + "-mutants")
    head = _git(tree, "rev-parse", "HEAD").stdout.strip()
    if not (wt / ".git").exists():
        _git(tree, "worktree", "prune")
        say(f"creating the mutants' worktree {wt} (once)")
        _git(tree, "worktree", "add", "-q", "--detach", str(wt), head)
    else:
        _git(wt, "checkout", "-q", "--detach", "-f", head)
    return wt


def _model_verdicts(wanted: list[str]) -> dict[str, bool]:
    """Whether the LKMM reaches the bad outcome for each model entry:
    "<test>.litmus <barrier>" without that barrier (model/run --mutants), or
    "<test>.litmus", a test that models the mutated code (model/run), each
    passing against the verdict Sometimes."""
    got = {}
    runner = str(REPO / "model" / "run")
    for mode, entries in (("--mutants", [w for w in wanted if " " in w]),
                          (None, [w for w in wanted if " " not in w])):
        if not entries:
            continue
        tests = sorted({w.split()[0] for w in entries})
        p = subprocess.run([runner, *([mode] if mode else []), *tests], cwd=REPO,
                           capture_output=True, text=True)
        print(p.stdout, end="", flush=True)
        for ln in p.stdout.splitlines():
            m = re.match(r"(PASS|FAIL)\s+(\S+)(?: without \((\w)\))?\s+(\w+)", ln)
            if m:
                key = m.group(2) + (f" {m.group(3)}" if m.group(3) else "")
                got[key] = m.group(1) == "PASS" and m.group(4) == "Sometimes"
    return {w: got.get(w, False) for w in wanted}


def _build(mfl: Flavor, base: Built, wt: Path) -> Built:
    bdir = cache_dir() / "build" / f"{mfl.name}-{safe(mfl.source.version)}"
    bdir.mkdir(parents=True, exist_ok=True)
    log = bdir / "build.log"
    log.write_text("")
    t0 = time.monotonic()
    with build_lock():
        configure(mfl, wt, bdir, log)
        _make(mfl, wt, bdir, ["bzImage"], log)
    rel = (bdir / "include" / "config" / "kernel.release").read_text().strip()
    return dataclasses.replace(base, flavor=mfl, bzimage=bdir / "arch/x86/boot/bzImage",
                               build_dir=bdir, kernelrelease=rel, source_tree=wt,
                               reused=False, build_seconds=time.monotonic() - t0)


def cmd_mutants(mx: Matrix, names: list[str]) -> int:
    fl, mutants = load_mutants(mx)
    if names:
        unknown = set(names) - {m.name for m in mutants}
        if unknown:
            raise LabError(f"unknown mutant(s) {', '.join(sorted(unknown))}; valid: "
                           f"{', '.join(m.name for m in mutants)}", rc=2)
        mutants = [m for m in mutants if m.name in names]
    rows, tools = _tools_row()
    out = new_results_dir("mutants")
    say(f"results: {out}")
    base = kernel(fl)            # the flavor's tree at its series, and its kernel
    mfl = dataclasses.replace(fl, name=f"{fl.name}-mutant",
                              localversion=f"{fl.localversion}-mutant")
    verdicts = _model_verdicts([m.model for m in mutants if m.model])
    wt = _worktree(fl) if any(not m.model for m in mutants) else None
    results = []
    for m in mutants:
        res = {"name": m.name, "patch": m.patch, "why": m.why}
        if m.model:
            res.update(verdict="killed" if verdicts[m.model] else "survived",
                       by=f"LKMM: {m.model}")
            results.append(res)
            continue
        assert wt is not None
        f = wt / m.file
        text = f.read_text()
        n = text.count(m.find)
        if n != 1:
            res.update(verdict="stale", by=f"snippet found {n} times in {m.file}")
            results.append(res)
            continue
        say(f"=== mutant {m.name} ({m.patch}): {m.why} ===")
        f.write_text(text.replace(m.find, m.replace))
        try:
            try:
                b = _build(mfl, base, wt)
            except LabError as e:
                res.update(verdict="build failed", by=str(e).splitlines()[0])
                results.append(res)
                continue
            row = _suites_row(mfl, ["guest"], out / m.name, tools, {},
                              label=f"mutant {m.name}", b=b, select=list(m.tests))
        finally:
            _git(wt, "checkout", "-q", "--", m.file)
        killed = row["failed"] > 0 or row["status"] != "ok"
        res.update(verdict="killed" if killed else "survived",
                   by=f"{row['status']}, {row['passed']} passed, {row['failed']} failed"
                      + (f" ({'; '.join(row['notes'])[:300]})" if row["notes"] else ""),
                   tests=list(m.tests))
        results.append(res)
    (out / "mutants.json").write_text(json.dumps(results, indent=2) + "\n")
    print()
    w = max(len(r["name"]) for r in results)
    for r in results:
        print(f"{r['name']:<{w}}  {r['patch']:<6}  {r['verdict']:<12}  {r['by'][:150]}")
    killed = sum(r["verdict"] == "killed" for r in results)
    survived = sum(r["verdict"] == "survived" for r in results)
    other = len(results) - killed - survived
    print(f"results: {out}")
    print(f"{killed} killed, {survived} survived"
          + (f", {other} stale or not built" if other else ""), flush=True)
    return 1 if survived or other else 0
