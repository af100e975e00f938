"""Profile the sharded learner pull (N daemons on this host, B=256 into GPU memory) with py-spy."""
import multiprocessing as mp, os, subprocess, sys, time, json, tempfile
from pathlib import Path
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import bench_shards as bsh
import prof_shards as ps

OUT = os.environ.get("OUT", "/tmp/out")


def fill(address, items=600):
    import numpy as np
    import gear_client as reverb
    rng = np.random.default_rng(0)
    with reverb.Client(address).trajectory_writer(num_keep_alive_refs=64) as w:
        for i in range(items):
            for t in range(64):
                w.append({"obs": rng.standard_normal(1024, dtype=np.float32), "action": np.int64(t),
                          "reward": np.float32(t)})
            w.create_item("t", 1.0, {k: w.history[k][-64:] for k in ("obs", "action", "reward")})


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        d = bsh.Daemons(n, Path(tmp), max_size=2048, prio_items=0)
        try:
            procs = [ctx.Process(target=fill, args=(a,)) for a in d.addresses]
            for p in procs: p.start()
            for p in procs: p.join()
            r = ps.phase(ctx, ps.pull, (d.addresses, 6.0), d.procs[0][0].pid, f"pull{n}", 6.0)
            json.dump(r, open(f"{OUT}/pull{n}.json", "w"), default=str)
        finally:
            d.stop()


if __name__ == "__main__":
    main()
