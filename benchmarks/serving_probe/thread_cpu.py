"""CPU seconds per thread of a process between two snapshots: python benchmarks/serving_probe/thread_cpu.py PID OUT.json
(snapshot), then python benchmarks/serving_probe/thread_cpu.py PID OUT.json --diff (prints the busiest threads)."""
import json
import os
import sys

pid, path = int(sys.argv[1]), sys.argv[2]
tick = os.sysconf("SC_CLK_TCK")
snap = {}
for tid in os.listdir(f"/proc/{pid}/task"):
    try:
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
    except OSError:
        continue
    fields = stat[stat.rindex(")") + 2:].split()
    snap[tid] = (comm, (int(fields[11]) + int(fields[12])) / tick)
if "--diff" not in sys.argv:
    json.dump(snap, open(path, "w"))
else:
    before = json.load(open(path))
    rows = sorted(((cpu - before.get(tid, (comm, 0.0))[1], tid, comm) for tid, (comm, cpu) in snap.items()), reverse=True)
    for cpu, tid, comm in rows[:8]:
        print(f"   thread {tid}{' (main)' if int(tid) == pid else ''} {comm}: {cpu:.2f} CPU s")
