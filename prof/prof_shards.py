"""Profile sharded insert/pull/select with py-spy."""
import multiprocessing as mp, os, subprocess, sys, time, json, tempfile
from pathlib import Path
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import numpy as np
import bench_shards as bsh

OUT = os.environ.get("OUT", "/tmp/out")
PYSPY = os.environ.get("PYSPY", "/tmp/site/bin/py-spy")


def spy(pid, name, seconds):
    return subprocess.Popen([PYSPY, "record", "--pid", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", "raw",
                             "-t", "--idle", "--nonblocking", "-o", f"{OUT}/{name}.txt"],
                            stdout=open(f"{OUT}/{name}.log", "w"), stderr=subprocess.STDOUT)


def insert_actor(addresses, seconds, q, go):
    q.put(os.getpid()); go.wait()
    out = mp.get_context("spawn").Queue() if False else None
    import queue as _q
    class O:
        def put(self, x): q.put(("done", x))
    bsh._actor(addresses, len(addresses), seconds, 0, O())


def pull(addresses, seconds, q, go):
    import gear_client as reverb
    ds = reverb.TrajectoryDataset(addresses, "t", batch_size=256, device="cuda")
    it = ds.batches(); next(it)
    q.put(os.getpid()); go.wait()
    n = 0; lat = []; start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter(); next(it); lat.append(time.perf_counter() - t); n += 1
    import cupy as cp; cp.cuda.runtime.deviceSynchronize()
    el = time.perf_counter() - start
    lat = np.array(lat) * 1e3
    q.put(("done", {"gbps": n * 256 * bsh.ITEM_BYTES / el / 1e9, "n": n, "p50": float(np.median(lat)),
                    "p90": float(np.percentile(lat, 90)), "plane": ds.plane}))
    ds.close()


def select(addresses, reps, q, go):
    import gear_client as reverb
    client = reverb.Client(addresses); s = client.sampler("p")
    for _ in range(3):
        s.sample(4096)
    q.put(os.getpid()); go.wait()
    lat = []
    for _ in range(reps):
        t = time.perf_counter(); s.sample(4096); lat.append(time.perf_counter() - t)
    q.put(("done", {"select_ms_p50": float(np.median(lat)) * 1e3, "kinds": s.kinds()}))


def phase(ctx, target, args, daemon_pid, name, seconds, n=1):
    q, go = ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=target, args=(*args, q, go)) for _ in range(n)]
    for p in ps: p.start()
    pids = [q.get(timeout=300) for _ in ps]
    spies = [spy(pids[0], f"{name}_client", seconds - 1), spy(daemon_pid, f"{name}_daemon", seconds - 1)]
    go.set()
    res = [q.get(timeout=seconds + 300)[1] for _ in ps]
    for s in spies: s.wait(60)
    for p in ps: p.join(30)
    print(name, json.dumps(res)[:2000], flush=True)
    return res


def main():
    ctx = mp.get_context("spawn")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = bsh.Daemons(2, Path(tmp), max_size=int(os.environ.get("MAX_SIZE", "2048")), prio_items=0)
        try:
            r = phase(ctx, insert_actor, (d.addresses, 6.0), d.procs[0][0].pid, "ins2", 6.0, n=4)
            out["insert2"] = sum(x[0] for x in r) * bsh.ITEM_BYTES / max(x[1] for x in r) / 1e9
            print("insert GB/s", out["insert2"], flush=True)
            out["pull2"] = phase(ctx, pull, (d.addresses, 6.0), d.procs[0][0].pid, "pull2", 6.0)
        finally:
            d.stop()
    items = int(os.environ.get("PRIO_ITEMS", "200000"))
    with tempfile.TemporaryDirectory() as tmp:
        d = bsh.Daemons(4, Path(tmp), max_size=16, prio_items=items)
        try:
            t = time.time()
            ps = [ctx.Process(target=bsh._fill_prio, args=(a, items, i)) for i, a in enumerate(d.addresses)]
            for p in ps: p.start()
            for p in ps: p.join()
            print("fill s", time.time() - t, flush=True)
            out["select4"] = phase(ctx, select, (d.addresses, 200), d.procs[0][0].pid, "sel4", 6.0)
        finally:
            d.stop()
    json.dump(out, open(f"{OUT}/shards.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
