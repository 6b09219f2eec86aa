#!/usr/bin/env python3
"""UDP sink for test_operator.py::test_openvpn_unmodified.

Counts the datagrams of tools/udpburst ("NDRP" magic, sender id, sequence)
that reach the far end of the tunnel. Speaks tools/tunreader's control
protocol, so tunlib.Reader drives it: one command per stdin line, one JSON
line per answer.

  stat            the counters
  wait KEY N MS   answer once counter KEY (pkts, ours, idK) >= N
                  ("result": "ok"), or once MS ms passed without a datagram
                  ("result": "stall")
  quit (or EOF)   the counters, then exit

usage: udpsink.py --bind IP --port P [--rcvbuf BYTES]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import sys
import time

MAX_IDS = 16
SO_RCVBUFFORCE = 33


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--rcvbuf", type=int, default=16 << 20)
    a = ap.parse_args()

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, a.rcvbuf)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, a.rcvbuf)
    s.bind((a.bind, a.port))
    s.setblocking(False)
    cnt = {"pkts": 0, "bytes": 0, "ours": 0, "other": 0, "per_id": [0] * MAX_IDS}
    last_pkt = time.monotonic()
    waiting = None  # (key, n, ms)
    stdin = sys.stdin.fileno()
    buf = b""

    def value(key: str) -> int:
        if key.startswith("id"):
            i = int(key[2:])
            return cnt["per_id"][i] if 0 <= i < MAX_IDS else 0
        return cnt.get(key, 0)

    def answer(event: str, result: str | None = None) -> None:
        d = {"event": event}
        if result:
            d["result"] = result
        d.update(cnt)
        d["rcvbuf"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        sys.stdout.write(json.dumps(d) + "\n")
        sys.stdout.flush()

    answer("ready")
    while True:
        r, _, _ = select.select([s, stdin], [], [], 0.05)
        if s in r:
            while True:
                try:
                    p = s.recv(65536)
                except BlockingIOError:
                    break
                cnt["pkts"] += 1
                cnt["bytes"] += len(p)
                last_pkt = time.monotonic()
                if len(p) >= 16 and p[:4] == b"NDRP":
                    cnt["ours"] += 1
                    ident = struct.unpack("!I", p[4:8])[0]
                    if ident < MAX_IDS:
                        cnt["per_id"][ident] += 1
                else:
                    cnt["other"] += 1
        if stdin in r:
            chunk = os.read(stdin, 4096)
            if not chunk:
                answer("quit")
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                w = line.decode().split()
                if not w:
                    continue
                if w[0] == "stat":
                    answer("stat")
                elif w[0] == "quit":
                    answer("quit")
                    return 0
                elif w[0] == "wait" and len(w) == 4:
                    waiting = (w[1], int(w[2]), int(w[3]))
                    last_pkt = time.monotonic()
                else:
                    answer("error")
        if waiting:
            key, n, ms = waiting
            if value(key) >= n:
                answer("wait", "ok")
                waiting = None
            elif (time.monotonic() - last_pkt) * 1000 >= ms:
                answer("wait", "stall")
                waiting = None


if __name__ == "__main__":
    sys.exit(main())
