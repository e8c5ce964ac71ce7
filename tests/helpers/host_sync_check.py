"""One process of tests/test_resilience.py's host-sync test: jax.distributed on CPU (no device program at all), then
HostSync's rounds as the trainer makes them: `any` with this process's flags (process 1 says True in round 2 only,
after a delay, so process 0 reaches that round's barrier first), then `to_lead` twice, then the start-up kinds through
the process's shared object: `from_lead` twice (process 0 late the second time) and `gather` twice (process 1 late
the first time). Prints what it got, as JSON.
    python tests/helpers/host_sync_check.py PORT RANK"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

from MaxOffload.parallel import host_sync  # noqa: E402
from MaxOffload.parallel.host_sync import HostSync  # noqa: E402

port, rank = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", 2, rank)
sync = HostSync(rank, 2)
agreed = []
for round_ in range(4):
    if rank == 1 and round_ == 2:
        time.sleep(1.0)  # the flag's owner arrives last: process 0 waits at the barrier, then reads it
    agreed.append(sync.any(rank == 1 and round_ == 2))
rows = [sync.to_lead([rank, 10 * rank + round_]) for round_ in range(2)]
shared = host_sync.shared()
assert shared is host_sync.shared() and shared.rank == rank and shared.count == 2
led = []
for round_ in range(2):
    if rank == 0 and round_ == 1:
        time.sleep(1.0)  # the others wait for process 0's value
    led.append(shared.from_lead({"round": round_, "from": rank}))
gathered = []
for round_ in range(2):
    if rank == 1 and round_ == 0:
        time.sleep(1.0)
    gathered.append(shared.gather(100 * round_ + rank))
print(json.dumps({"any": agreed, "to_lead": rows, "from_lead": led, "gather": gathered}), flush=True)
jax.distributed.shutdown()
