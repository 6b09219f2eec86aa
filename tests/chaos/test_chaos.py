"""The chaos round (tests/chaos/chaos.py) as pytest checks, one per property.

Runs once per session; DURATION (seconds, default 120) and SEED (default:
random, printed) come from the environment (`make test`, `make chaos`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import chaos
from tunlib import lacks


@pytest.fixture(scope="module")
def res():
    d = chaos.env_defaults()
    r = chaos.run(d["duration"], d["seed"], d["tools"],
                  Path(d["results"]) if d["results"] else None)
    print(f"chaos seed {d['seed']}: {chaos.verdict(r) or 'clean'}")
    return r


def test_run_completed(res):
    assert not res.get("error"), f"chaos run failed (seed {res['seed']}): {res['error']}"
    assert sum(res.get("actions", {}).values()) > 0, "no chaos action ran"


def test_no_ring_drops_with_backpressure_and_qdisc(res):
    w = res.get("windows", {})
    if not res.get("bp_supported"):
        lacks("backpressure", f"no IFF_BACKPRESSURE: {w.get('unprotected_drops')} drops, "
              "none protected")
    assert w.get("protected", 0) > 0, "no steady window had backpressure and a qdisc"
    assert w["protected_drops"] == 0, \
        f"seed {res['seed']}: ring drops in protected windows: {w['bad_windows'][:5]}"


def test_drains_after_chaos(res):
    assert res.get("drain", {}).get("ok"), f"seed {res['seed']}: {res.get('drain')}"


def test_fresh_burst_delivered(res):
    b = res.get("burst", {})
    assert b.get("ok"), f"seed {res['seed']}: {b}"


def test_no_splat_in_tun_vhost_ptr_ring(res):
    sp = res.get("splats", {})
    if sp.get("other"):
        print(f"other kernel reports (not ours): {sp['other']}")
    assert not sp.get("ours"), f"seed {res['seed']}: {sp['ours']}"


def test_kmemleak_clean(res):
    k = res.get("kmemleak", {})
    if not k.get("available"):
        pytest.skip("kernel without kmemleak")
    if k.get("leaks"):
        print(f"kmemleak: {k['leaks']} unreferenced objects, {k['ours']} ours")
    assert not k.get("ours"), f"seed {res['seed']}: {k}"
