"""The series' kselftest (tools/testing/selftests/net/tun_backpressure.c,
from "selftests: net: add a test for tun IFF_BACKPRESSURE"), built in the
guest through the kernel's own kselftest Makefile (net/Makefile + lib.mk,
output outside the read-only tree) and run on every flavor: it
feature-detects IFF_BACKPRESSURE itself, so the same binary passes on our
kernel and on mainline, and on stock checks the legacy drops and skips the
rest.

The lab passes the tree that holds it in NODROP_KSELFTEST_DIR (the 6.12
series tree). Its skips are counted from the harness's "# Totals" line (the
harness exits 0 when some tests skip): on a flavor that declares
backpressure every case must run.

The 7.3 net-next series brings a selftest of its own,
net/tun_bp_qstats.py (lib/py, qstats through ynl): it runs from the booted
flavor's own tree (NODROP_OWN_KSELFTEST_DIR) on the flavors that declare
"kselftest-qstats", and prints the same "# Totals" line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

from tunlib import declares, lacks, log

TOTALS = re.compile(r"# Totals: pass:(\d+) fail:(\d+) xfail:(\d+) xpass:(\d+) "
                    r"skip:(\d+) error:(\d+)")


def _check_totals(r: subprocess.CompletedProcess, record_property) -> None:
    """Pass only if the run reported totals with no failure, ran something
    and, on a flavor that declares backpressure, skipped nothing."""
    out = r.stdout + r.stderr
    log(out[-6000:])
    m = TOTALS.search(out)
    assert m, f"no '# Totals' line from the kselftest harness (rc {r.returncode})"
    passed, failed, _, _, skipped, errors = (int(x) for x in m.groups())
    record_property("totals", m.group(0))
    if r.returncode != 0 or failed or errors:
        cases = re.findall(r"^not ok \d+ (\S+)", out, re.M)
        pytest.fail(f"kselftest failed (rc {r.returncode}): {m.group(0)}; "
                    f"failed cases: {' '.join(cases)}", pytrace=False)
    assert passed > 0, f"kselftest ran nothing: {m.group(0)}"
    if skipped and declares("backpressure"):
        pytest.fail(f"the flavor declares backpressure but the kselftest skipped "
                    f"{skipped} case(s): {m.group(0)}", pytrace=False)


def test_kselftest_tun_backpressure(record_property):
    d = os.environ.get("NODROP_KSELFTEST_DIR", "")
    net = os.path.join(d, "net")
    if not d or not os.path.isfile(os.path.join(net, "tun_backpressure.c")):
        lacks("kselftest", "no tree with the series' kselftest (build nodrop-6.12 first)")
    with tempfile.TemporaryDirectory(prefix="nodrop-ksft-") as out:
        exe = os.path.join(out, "tun_backpressure")
        mk = subprocess.run(["make", "-s", "-C", net, f"OUTPUT={out}", exe],
                            capture_output=True, text=True)
        assert mk.returncode == 0, (f"kselftest does not build through "
                                    f"{net}/Makefile:\n{(mk.stdout + mk.stderr)[-3000:]}")
        r = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    _check_totals(r, record_property)


def test_kselftest_tun_bp_qstats(record_property):
    net = os.path.join(os.environ.get("NODROP_OWN_KSELFTEST_DIR", ""), "net")
    if not os.path.isfile(os.path.join(net, "tun_bp_qstats.py")):
        lacks("kselftest-qstats", "the booted flavor's tree has no net/tun_bp_qstats.py")
    r = subprocess.run([sys.executable, "tun_bp_qstats.py"], cwd=net,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                       capture_output=True, text=True, timeout=600)
    _check_totals(r, record_property)
