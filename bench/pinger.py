"""ICMP echo RTTs at sub-millisecond resolution (scenario 6), in-guest, stdlib only.

usage: pinger.py DST COUNT MEAN_INTERVAL_S [SEED]

Prints {"event": "ready"} once its raw socket is open, waits for one line on
stdin ("go"), then sends COUNT echo requests to DST, the gaps drawn
uniformly from [0.5, 1.5] x MEAN_INTERVAL_S, so that the send times are
not locked in phase to the 1 ms period of scenario 6's paced tunnel reader
(a fixed 50 ms interval under QEMU icount lands every ping at the same
point of the pacer's cycle, and the RTTs come out in whole milliseconds).
The send time is taken just before sendto(), the receive time is the
kernel's (SO_TIMESTAMPNS), both CLOCK_REALTIME in ns. Replies later than 2 s
after the last request count as lost. Prints one JSON line at the end:
{"event": "done", "sent": N, "rtt_us": [...]} (answered requests, in send
order, microseconds with three decimals).
"""

from __future__ import annotations

import json
import os
import random
import select
import socket
import struct
import sys
import time

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
ICMP_ECHO, ICMP_ECHOREPLY = 8, 0
LATE_S = 2.0


def checksum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def request(ident: int, seq: int) -> bytes:
    payload = b"nodrop-s6-pinger".ljust(56, b"\0")
    head = struct.pack("!BBHHH", ICMP_ECHO, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ICMP_ECHO, 0, checksum(head + payload), ident, seq) + payload


def main() -> int:
    dst, count, mean = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if not 0 < count <= 0xFFFF:
        sys.exit("pinger: COUNT must be 1..65535 (one ICMP sequence space)")
    rnd = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else None)
    sk = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    sk.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    ident = os.getpid() & 0xFFFF
    print(json.dumps({"event": "ready"}), flush=True)
    sys.stdin.readline()
    sent: dict[int, int] = {}
    rtt: dict[int, float] = {}
    seq = 0
    next_send = time.monotonic()
    deadline = None
    while True:
        now = time.monotonic()
        if seq < count and now >= next_send:
            sent[seq] = time.time_ns()
            sk.sendto(request(ident, seq), (dst, 0))
            seq += 1
            next_send += mean * rnd.uniform(0.5, 1.5)
            if seq == count:
                deadline = now + LATE_S
            continue
        if deadline is not None and (now >= deadline or len(rtt) == count):
            break
        wait = (next_send if seq < count else deadline) - now
        if not select.select([sk], [], [], max(0.0, wait))[0]:
            continue
        data, anc, _, _ = sk.recvmsg(2048, socket.CMSG_SPACE(16))
        t_rx = next((struct.unpack("qq", d[:16]) for lvl, typ, d in anc
                     if lvl == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS), None)
        ihl = (data[0] & 0x0F) * 4
        if len(data) < ihl + 8:
            continue
        typ, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
        if typ != ICMP_ECHOREPLY or rid != ident:
            continue
        s = rseq
        if s not in sent or s in rtt:
            continue
        rx_ns = t_rx[0] * 1_000_000_000 + t_rx[1] if t_rx else time.time_ns()
        rtt[s] = (rx_ns - sent[s]) / 1000.0
    print(json.dumps({"event": "done", "sent": seq,
                      "rtt_us": [round(rtt[k], 3) for k in sorted(rtt)]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
