"""The benchmark scenarios, one module each (see docs/bench.md).

Every module defines KEY (its number in SCENARIOS=...), NAME (the JSON
file and the report's section) and run(ctx) -> dict (the scenario's JSON:
title, params, points with their repetitions).
"""

from . import (s1_pktgen_tap, s2_pktgen_vhost, s3_tcp_grid, s4_video, s5_parallel,
               s6_latency, s7_mq_steering)

MODULES = [s1_pktgen_tap, s2_pktgen_vhost, s3_tcp_grid, s4_video, s5_parallel, s6_latency,
           s7_mq_steering]
BY_KEY = {m.KEY: m for m in MODULES}
DEFAULT_ORDER = ["1", "4", "5", "6", "7", "3", "2"]
