"""One batch out of the parts several shards gave: the learner sees a single table's batch.

Each part arrives over its own plane (shm gathered on the GPU or the CPU,
inline on the CPU). The parts are scattered into one padded batch in a random
order (a part must not sit at fixed rows, as i.i.d. picks of one table would
not), on the GPU when ``device`` names one (inline parts are copied up once).
Columns of different padded lengths (shards whose slots hold different maximum
lengths) are padded to the longest; valid lengths travel with the batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gear_client.data_planes.batch import SampledBatch
from gear_client.data_planes.shm import gpu_index, is_gpu_device


def assemble(parts: list[SampledBatch], rng: np.random.Generator, device: Any = None) -> SampledBatch:
    """The parts as one batch (rows shuffled); a single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p in parts[1:]:
        if p.structure != first.structure or tuple(p.squeeze) != tuple(first.squeeze) or \
                len(p.columns) != len(first.columns):
            raise ValueError("the shards of this table hold items of different structures; configure every "
                             "daemon's table alike (same signature)")
    total = sum(len(p) for p in parts)
    order = rng.permutation(total)
    rows = []
    start = 0
    for p in parts:
        rows.append(order[start:start + len(p)])
        start += len(p)
    if is_gpu_device(device):
        import cupy as cp

        with cp.cuda.Device(gpu_index(device)):
            columns = _scatter(parts, rows, total, cp)
    else:
        columns = _scatter(parts, rows, total, np)
    inverse = np.concatenate(rows)

    def gather(field: str) -> np.ndarray:
        values = np.concatenate([np.asarray(getattr(p, field)) for p in parts])
        out = np.empty_like(values)
        out[inverse] = values
        return out

    return SampledBatch(gather("keys"), gather("probabilities"), gather("table_sizes"), gather("priorities"),
                        gather("times_sampled"), columns, gather("lengths"), first.structure, first.squeeze,
                        plane="+".join(sorted({p.plane for p in parts})))


def _scatter(parts: list[SampledBatch], rows: list[np.ndarray], total: int, xp: Any) -> list[Any]:
    columns = []
    for c in range(len(parts[0].columns)):
        arrays = [p.columns[c] for p in parts]
        dtype = np.dtype(str(arrays[0].dtype))
        if parts[0].squeeze[c]:
            shape = (total, *arrays[0].shape[1:])
        else:
            steps = max(int(a.shape[1]) for a in arrays)
            shape = (total, steps, *arrays[0].shape[2:])
        out = xp.zeros(shape, dtype)
        for a, r in zip(arrays, rows, strict=True):
            if len(r) == 0:
                continue
            index = xp.asarray(r)
            if parts[0].squeeze[c]:
                out[index] = xp.asarray(a)
            else:
                out[index, :a.shape[1]] = xp.asarray(a)
        columns.append(out)
    return columns


def rows(batch: SampledBatch, start: int, end: int) -> SampledBatch:
    """Rows ``start:end`` of a batch, as views (a read-ahead group cut into batches)."""
    if start == 0 and end == len(batch):
        return batch
    cut = slice(start, end)
    return SampledBatch(batch.keys[cut], batch.probabilities[cut], batch.table_sizes[cut], batch.priorities[cut],
                        batch.times_sampled[cut], [c[cut] for c in batch.columns], batch.lengths[cut],
                        batch.structure, batch.squeeze, plane=batch.plane)
