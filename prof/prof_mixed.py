"""Profile: mixed load (K same-host actors + learner B=256 shm->GPU), py-spy on daemon and learner."""
import multiprocessing as mp, os, subprocess, sys, time, json
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import numpy as np
import bench_scale as bs

OUT = os.environ.get("OUT", "/tmp/out")
PYSPY = os.environ.get("PYSPY", "/tmp/site/bin/py-spy")


def learner(address, seconds, device, ready, go, results):
    from gear_client.data_planes import PlaneSampler
    with PlaneSampler(address, "t", planes=["shm"], device=device) as sampler:
        stream = sampler.batches(bs.BATCH, prefetch=int(os.environ.get('PREFETCH', '2')), batches_per_select=int(os.environ.get('BPS', '1')))
        for _ in range(3):
            next(stream)
        ready.put(os.getpid())
        go.wait()
        start = time.perf_counter(); items = 0; lat = []
        while time.perf_counter() - start < seconds:
            t = time.perf_counter(); items += len(next(stream)); lat.append(time.perf_counter() - t)
        el = time.perf_counter() - start
        stream.close()
        lat = np.array(lat) * 1e3
        results.put({"learner_gbps": items * bs.ITEM_BYTES / el / 1e9, "n": len(lat),
                     "next_ms_p50": float(np.median(lat)), "p90": float(np.percentile(lat, 90)),
                     "max": float(lat.max()), "sum_over_5ms": float(lat[lat > 5].sum())})


def probe(address, seconds, go, results):
    import gear_client as reverb
    c = reverb.Client(address)
    c.server_info()
    go.wait()
    lat = []; start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter(); c.server_info(); lat.append(time.perf_counter() - t); time.sleep(0.01)
    lat = np.array(lat) * 1e3
    results.put({"server_info_ms_p50": float(np.median(lat)), "p90": float(np.percentile(lat, 90)), "max": float(lat.max())})


def spy(pid, name, seconds):
    extra = ["--gil"] if os.environ.get("GIL") == "1" else ["--idle"]
    return subprocess.Popen([PYSPY, "record", "--pid", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", "raw",
                             "-t", *extra, "--nonblocking", "-o", f"{OUT}/{name}.txt"],
                            stdout=open(f"{OUT}/{name}.log", "w"), stderr=subprocess.STDOUT)


def serve_variant(max_size, workers, pq, stop, switch):
    if switch:
        sys.setswitchinterval(switch)
    bs.serve(max_size, workers, pq, stop)


def main():
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    switch = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    do_spy = os.environ.get("SPY", "1") == "1"
    seconds = 8.0
    ctx = mp.get_context("spawn")
    pq, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve_variant, args=(4096, 8, pq, stop, switch)); server.start()
    address = f"localhost:{pq.get(timeout=60)}"
    out = {}
    try:
        pre = bs.run_round(ctx, address, 2, False, 2.0)  # fill the table first
        print("prefill", pre["items"], flush=True)
        for kk in (0, k):
            ready, go, res, lres, pres = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Queue()
            procs = [ctx.Process(target=bs.actor, args=(address, False, seconds, ready, go, res)) for _ in range(kk)]
            lp = ctx.Process(target=learner, args=(address, seconds, "cuda", ready, go, lres))
            pp = ctx.Process(target=probe, args=(address, seconds, go, pres))
            for p in procs + [lp, pp]:
                p.start()
            pids = [ready.get(timeout=120) for _ in range(kk + 1)]
            spies = []
            if kk and do_spy:
                spies = [spy(server.pid, f"daemon_k{kk}", seconds - 1), spy(lp.pid, f"learner_k{kk}", seconds - 1),
                         spy(procs[0].pid, f"actor_k{kk}", seconds - 1)]
            go.set()
            acts = [res.get(timeout=seconds + 120) for _ in range(kk)]
            r = {"learner": lres.get(timeout=seconds + 120), "probe": pres.get(timeout=seconds + 60),
                 "actor_gbps": sum(a["items"] for a in acts) * bs.ITEM_BYTES / seconds / 1e9}
            for s in spies:
                s.wait(60)
            for p in procs + [lp, pp]:
                p.join(30)
            out[kk] = r
            print(kk, json.dumps(r), flush=True)
    finally:
        stop.set(); server.join(30)
        if server.is_alive():
            server.kill()
    json.dump(out, open(f"{OUT}/mixed_{k}_{switch}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
