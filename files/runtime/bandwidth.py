"""Sustained memory bandwidth of this host, STREAM-triad style, with the engine's own numpy.

One process per usable CPU, each pinned to its CPU and touching its own arrays first (so
the kernel places them on that CPU's NUMA node), all started together by a barrier. Each
repeats a = b + 3c as numpy does it (a = 3c, then a += b: 40 bytes moved per element) for
TRIAD_SECONDS; the figure is every process's bytes over the slowest one's time. Arrays of
TRIAD_MIB MiB are far beyond any last-level cache slice. Prints one JSON line.
"""

import json
import multiprocessing as mp
import os
import time

import numpy as np

MIB = int(os.environ.get("TRIAD_MIB", "32"))
SECONDS = float(os.environ.get("TRIAD_SECONDS", "2"))
N = MIB * 2**20 // 8
BYTES_PER_ELEMENT = 40


def worker(cpu, barrier, results):
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass
    a, b, c = np.zeros(N), np.ones(N), np.full(N, 2.0)
    np.multiply(c, 3.0, out=a)
    barrier.wait()
    t0, rounds = time.perf_counter(), 0
    while time.perf_counter() - t0 < SECONDS:
        np.multiply(c, 3.0, out=a)
        np.add(a, b, out=a)
        rounds += 1
    results.put((rounds, time.perf_counter() - t0))


def main():
    cpus = sorted(os.sched_getaffinity(0))
    barrier, results = mp.Barrier(len(cpus)), mp.Queue()
    procs = [mp.Process(target=worker, args=(cpu, barrier, results)) for cpu in cpus]
    for p in procs:
        p.start()
    done = [results.get(timeout=SECONDS * 20 + 120) for _ in procs]
    for p in procs:
        p.join()
    moved = sum(r for r, _ in done) * N * BYTES_PER_ELEMENT
    print(json.dumps({"bandwidth_bytes_per_s": moved / max(t for _, t in done), "processes": len(cpus),
                      "array_mib": MIB, "seconds": SECONDS, "method": "numpy triad a=b+3c, 40 B/element"}))


if __name__ == "__main__":
    main()
