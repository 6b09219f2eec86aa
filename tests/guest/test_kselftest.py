"""The series' kselftest (tools/testing/selftests/net/tun_backpressure.c,
from "selftests: net: add a test for tun IFF_BACKPRESSURE"), built in the
guest and run on every flavor: it feature-detects IFF_BACKPRESSURE itself,
so the same binary passes on our kernel and on mainline, and on stock
checks the legacy drops and skips the rest.

The lab passes the tree that holds it in NODROP_KSELFTEST_DIR (the 6.12
series tree; empty until a flavor with that series was built: skip)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from tunlib import log

KSFT_SKIP = 4


def test_kselftest_tun_backpressure(record_property):
    d = os.environ.get("NODROP_KSELFTEST_DIR", "")
    src = os.path.join(d, "net", "tun_backpressure.c")
    if not d or not os.path.isfile(src):
        pytest.skip("no tree with the series' kselftest yet (build nodrop-6.12 first)")
    with tempfile.TemporaryDirectory(prefix="nodrop-ksft-") as tmp:
        exe = os.path.join(tmp, "tun_backpressure")
        cc = subprocess.run(["gcc", "-Wall", "-O2", "-I", d, "-o", exe, src],
                            capture_output=True, text=True)
        assert cc.returncode == 0, f"kselftest does not build:\n{cc.stderr[-3000:]}"
        r = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    log(out[-6000:])
    totals = [ln for ln in out.splitlines() if ln.startswith("# Totals")]
    record_property("totals", totals[-1] if totals else "none")
    if r.returncode == KSFT_SKIP:
        pytest.skip(f"kselftest skipped: {totals}")
    assert r.returncode == 0, f"kselftest failed (rc {r.returncode}): {totals}"
