"""uapi of IFF_BACKPRESSURE (0x0080), brief test 3.

* TUNGETFEATURES reports the usual bits; 0x0080 is what has_backpressure()
  keys on.
* TUNSETIFF with IFF_BACKPRESSURE succeeds on every kernel. A kernel that
  advertises it reports it back in TUNGETIFF; an older kernel silently drops
  the bit (TUNSETIFF succeeds, TUNGETIFF does not report it) - this is why
  programs must use TUNGETFEATURES. Without the flag, TUNGETIFF never reports
  it (backpressure is opt-in).
* An undefined bit (0x0008) is ignored by TUNSETIFF on all these kernels.
* Re-attaching to an existing device with a different IFF_BACKPRESSURE bit
  than the device has: the bit is one of the device's TUN_FEATURES, as on
  mainline 7.2+. The TUNSETIFF that attaches the first queue of an existing
  device (a persistent device being reopened) sets or clears it; a further
  queue of a multi-queue device leaves the device's flags as they are. Both
  succeed. The same assertions hold on every backpressure kernel (ours and
  mainline, call by call); on older kernels the bit is ignored, so the
  re-attach succeeds and the bit is never reported.
* The kernel has exactly the kernel features its lab flavor declares
  (lab/flavors.toml `features`, NODROP_FEATURES): a series that loses its
  feature bit, switch, counters or BQL fails here, and so does a
  declaration that claims less than the kernel has.
"""

from __future__ import annotations

import os

import pytest

from tunlib import (IFF_BACKPRESSURE, IFF_MULTI_QUEUE, IFF_NO_PI, IFF_ONE_QUEUE,
                    IFF_TAP, IFF_TUN, IFF_UNDEFINED_BIT, IFF_VNET_HDR, Tun,
                    bql, declared_features, flag_names, get_features, has_priv_flag, log,
                    qstats, set_priv_flag, setup_ip)

TYPES = [pytest.param(IFF_TUN, id="tun"), pytest.param(IFF_TAP, id="tap")]


def _kernel_has(env) -> dict[str, bool]:
    """The kernel features of tunlib.FEATURES, probed on one tun."""
    t = env.tun("ndhave0", IFF_TUN | IFF_NO_PI)
    setup_ip(t.name, tap=False)
    switch = has_priv_flag(t.name, "backpressure")
    if switch:
        set_priv_flag(t.name, "backpressure", True)
    return {"backpressure": bool(get_features() & IFF_BACKPRESSURE),
            "switch": switch,
            "bql": has_priv_flag(t.name, "bql"),
            "qstats": qstats(t.name) is not None,
            "bql-sysfs": bql(t.name) is not None,
            "vhost-net": os.path.exists("/dev/vhost-net"),
            "pktgen": os.path.isdir("/proc/net/pktgen")}


def test_declared_features(env, record_property):
    declared = declared_features()
    if declared is None:
        pytest.skip("this row declares no features (NODROP_FEATURES unset): nothing to compare with")
    have = _kernel_has(env)
    record_property("kernel_features", " ".join(k for k, v in have.items() if v))
    wrong = {k: v for k, v in have.items() if v != (k in declared)}
    assert not wrong, ("the kernel and its flavor's declaration differ: "
                       + ", ".join(f"{k}: kernel {'has' if v else 'lacks'} it, flavor "
                                   f"{'does not declare' if v else 'declares'} it"
                                   for k, v in wrong.items()))


def test_features_reported(env, record_property):
    feat = get_features()
    log(f"TUNGETFEATURES=0x{feat:04x} ({flag_names(feat)}) "
        f"backpressure={bool(feat & IFF_BACKPRESSURE)}")
    record_property("features", hex(feat))
    core = IFF_TUN | IFF_TAP | IFF_NO_PI | IFF_ONE_QUEUE | IFF_VNET_HDR | IFF_MULTI_QUEUE
    assert feat & core == core, f"features=0x{feat:04x} lack 0x{core & ~feat:04x}"
    assert not feat & IFF_UNDEFINED_BIT, f"features=0x{feat:04x} report undefined bit"
    # a fd attached to a device reports the same features
    t = env.tun("ndfeat0", IFF_TUN | IFF_NO_PI)
    assert get_features(t.fd) == feat


@pytest.mark.parametrize("kind", TYPES)
def test_flag_roundtrip(env, kind):
    t = env.tun("ndflag0", kind | IFF_NO_PI | IFF_BACKPRESSURE)  # never fails
    got = t.get_iff()
    log(f"requested=0x{t.requested:04x} TUNGETIFF=0x{got:04x} ({flag_names(got)}) "
        f"bp_kernel={env.bp}")
    if env.bp:
        assert got & IFF_BACKPRESSURE, \
            f"kernel advertises 0x0080 but TUNGETIFF=0x{got:04x} lacks it"
    else:
        assert not got & IFF_BACKPRESSURE, \
            f"kernel without the feature reports 0x0080: TUNGETIFF=0x{got:04x}"
    assert got & (kind | IFF_NO_PI) == kind | IFF_NO_PI

    u = env.tun("ndflag1", kind | IFF_NO_PI)
    got = u.get_iff()
    log(f"without the flag: TUNGETIFF=0x{got:04x}")
    assert not got & IFF_BACKPRESSURE, \
        f"backpressure must be opt-in: TUNGETIFF=0x{got:04x} without the flag"


@pytest.mark.parametrize("kind", TYPES)
def test_unknown_bit_ignored(env, kind):
    t = env.tun("ndunk0", kind | IFF_NO_PI | IFF_UNDEFINED_BIT)
    got = t.get_iff()
    log(f"requested=0x{t.requested:04x} TUNGETIFF=0x{got:04x}")
    assert not got & IFF_UNDEFINED_BIT, f"TUNGETIFF=0x{got:04x} reports 0x0008"
    assert got & (kind | IFF_NO_PI) == kind | IFF_NO_PI


def _open_persistent(env, name: str, flags: int) -> None:
    t = Tun(name, flags)
    t.set_persist(True)
    env.persistent.append((name, flags))
    t.close()


def _reattach(env, what: str, name: str, flags: int, want_bp: bool) -> int:
    """TUNSETIFF on an existing device must succeed; TUNGETIFF then reports
    IFF_BACKPRESSURE iff `want_bp` on a backpressure kernel, never on an old
    one. Returns the flags TUNGETIFF reported."""
    t = Tun(name, flags)  # raises on a refusal: every kernel accepts it
    got = t.get_iff()
    t.close()
    log(f"{what}: accepted; TUNGETIFF afterwards=0x{got:04x} ({flag_names(got)})")
    assert bool(got & IFF_BACKPRESSURE) == (want_bp and env.bp), \
        f"{what}: TUNGETIFF=0x{got:04x}, expected backpressure={want_bp and env.bp}"
    return got


@pytest.mark.parametrize("device_bp,attach_bp", [(True, False), (False, True)],
                         ids=["device-on-attach-off", "device-off-attach-on"])
def test_reattach_mismatch_persistent(env, device_bp, attach_bp):
    """The first queue of a reopened device sets the flag as it asks."""
    base = IFF_TUN | IFF_NO_PI
    name = "ndmis0"
    _open_persistent(env, name, base | (IFF_BACKPRESSURE if device_bp else 0))
    _reattach(env, f"re-attach to persistent device (bp={device_bp}) with bp={attach_bp}",
              name, base | (IFF_BACKPRESSURE if attach_bp else 0), want_bp=attach_bp)


@pytest.mark.parametrize("device_bp,attach_bp", [(True, False), (False, True)],
                         ids=["queue0-on-queue1-off", "queue0-off-queue1-on"])
def test_reattach_mismatch_multiqueue(env, device_bp, attach_bp):
    """A further queue of a multi-queue device keeps the device's flag."""
    base = IFF_TUN | IFF_NO_PI | IFF_MULTI_QUEUE
    name = "ndmis1"
    q0 = env.tun(name, base | (IFF_BACKPRESSURE if device_bp else 0))
    _reattach(env, f"second queue (bp={attach_bp}) on a device with bp={device_bp}",
              name, base | (IFF_BACKPRESSURE if attach_bp else 0), want_bp=device_bp)
    got = q0.get_iff()
    log(f"queue 0 TUNGETIFF=0x{got:04x}")
    assert bool(got & IFF_BACKPRESSURE) == (device_bp and env.bp), \
        f"queue 0 TUNGETIFF=0x{got:04x} changed by the second queue"
