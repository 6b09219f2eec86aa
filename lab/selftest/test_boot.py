"""Lab selftest: proves build -> boot -> run -> results works for a flavor.

Runs in the guest on every `make test`, before tests/guest. The lab exports
NODROP_KERNELRELEASE (what the build produced) and NODROP_UPSTREAM_VERSION
(VERSION.PATCHLEVEL.SUBLEVEL of the flavor's source package).
"""

import os
import platform
import stat

import pytest

EXPECTED = os.environ.get("NODROP_KERNELRELEASE")
UPSTREAM = os.environ.get("NODROP_UPSTREAM_VERSION")

pytestmark = pytest.mark.skipif(not EXPECTED, reason="not running under the NODROP lab")


def test_kernel_is_the_flavor_built():
    release = platform.release()
    assert release == EXPECTED
    assert release.startswith(UPSTREAM + "-") or release == UPSTREAM, \
        f"guest kernel {release} is not from source version {UPSTREAM}"


def test_dev_net_tun():
    st = os.stat("/dev/net/tun")
    assert stat.S_ISCHR(st.st_mode)
    fd = os.open("/dev/net/tun", os.O_RDWR)
    os.close(fd)


def test_results_dir_is_writable():
    path = os.path.join(os.environ["NODROP_RESULTS"], "selftest-write-check")
    with open(path, "w") as f:
        f.write("ok\n")
    with open(path) as f:
        assert f.read() == "ok\n"
