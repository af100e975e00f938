// Selection kernels over per-slot metadata arrays (priority f64, valid u8,
// insert_seq i64, update_seq i64, times_sampled i32), indexed by slot.
//
// Every kernel has a NumPy twin in kernels/twins.py with the same semantics;
// where the arithmetic is the same IEEE operations in the same order, the twin
// gives bit-identical results (see docs/KERNELS.md).
#include "gear_common.cuh"

#define MODE_PRIORITIZED 0
#define MODE_UNIFORM 1

// ---------------------------------------------------------------------------
// Weights and their two-level inclusive scan.
//
// Tile t covers slots [t * TILE, (t + 1) * TILE). Thread j of a tile folds its
// SCAN_ITEMS weights left to right; thread totals are folded left to right by
// one thread (so each thread's exclusive prefix is exactly the previous
// thread's last cumulative value, and the cumulative array is monotone); the
// tile's cumulative values are excl + running. The last tile to finish folds
// the tile sums into block_prefix[nb + 1] and the valid counts into
// count_prefix[nb + 1].
// ---------------------------------------------------------------------------
#define SCAN_THREADS 256
#define SCAN_ITEMS 16
#define SCAN_TILE (SCAN_THREADS * SCAN_ITEMS)

__device__ __forceinline__ double gear_weight(double p, u8 valid, double exponent, int mode) {
    if (!valid) return 0.0;
    if (mode == MODE_UNIFORM) return 1.0;
    if (!(p > 0.0)) return 0.0;  // priority 0 has weight 0, even for exponent 0
    if (exponent == 1.0) return p;
    if (exponent == 0.0) return 1.0;
    return pow(p, exponent);
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
gear_weight_scan(const double* __restrict__ priority, const u8* __restrict__ valid, i64 n,
                 double exponent, int mode,
                 double* __restrict__ local_cum,     // [n]
                 double* __restrict__ block_sum,     // [nb]
                 i64* __restrict__ block_count,      // [nb]
                 double* __restrict__ block_prefix,  // [nb + 1]
                 i64* __restrict__ count_prefix,     // [nb + 1]
                 u32* __restrict__ done)             // [1], zero between launches
{
    __shared__ double s_total[SCAN_THREADS];
    __shared__ i32 s_count[SCAN_THREADS];
    __shared__ double s_excl[SCAN_THREADS];
    __shared__ bool s_last;

    const i64 base = (i64)blockIdx.x * SCAN_TILE + (i64)threadIdx.x * SCAN_ITEMS;
    double run[SCAN_ITEMS];
    double acc = 0.0;
    i32 cnt = 0;
    if (base + SCAN_ITEMS <= n) {
        const double2* p2 = reinterpret_cast<const double2*>(priority + base);
        const uint4 v = *reinterpret_cast<const uint4*>(valid + base);
        const u32 vw[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS / 2; ++k) {
            const double2 d = (mode == MODE_UNIFORM) ? make_double2(0.0, 0.0) : p2[k];
            const u8 v0 = (u8)((vw[(2 * k) / 4] >> (8 * ((2 * k) % 4))) & 0xffu);
            const u8 v1 = (u8)((vw[(2 * k + 1) / 4] >> (8 * ((2 * k + 1) % 4))) & 0xffu);
            const double w0 = gear_weight(d.x, v0, exponent, mode);
            const double w1 = gear_weight(d.y, v1, exponent, mode);
            cnt += (v0 != 0) + (v1 != 0);
            acc = __dadd_rn(acc, w0);
            run[2 * k] = acc;
            acc = __dadd_rn(acc, w1);
            run[2 * k + 1] = acc;
        }
    } else {
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; ++k) {
            const i64 i = base + k;
            double w = 0.0;
            if (i < n) {
                const u8 vi = valid[i];
                w = gear_weight(mode == MODE_UNIFORM ? 0.0 : priority[i], vi, exponent, mode);
                cnt += (vi != 0);
            }
            acc = __dadd_rn(acc, w);
            run[k] = acc;
        }
    }
    s_total[threadIdx.x] = acc;
    s_count[threadIdx.x] = cnt;
    __syncthreads();
    if (threadIdx.x == 0) {
        double e = 0.0;
        i64 c = 0;
        for (int t = 0; t < SCAN_THREADS; ++t) {
            s_excl[t] = e;
            e = __dadd_rn(e, s_total[t]);
            c += s_count[t];
        }
        block_sum[blockIdx.x] = e;
        block_count[blockIdx.x] = c;
    }
    __syncthreads();
    const double excl = s_excl[threadIdx.x];
#pragma unroll
    for (int k = 0; k < SCAN_ITEMS; ++k) {
        const i64 i = base + k;
        if (i < n) local_cum[i] = __dadd_rn(excl, run[k]);
    }

    // The last tile to finish folds the tile sums (the classic fence + counter pattern).
    if (threadIdx.x == 0) {
        __threadfence();
        const u32 ticket = atomicAdd(done, 1u);
        s_last = (ticket == gridDim.x - 1);
    }
    __syncthreads();
    if (s_last && threadIdx.x == 0) {
        __threadfence();
        const i64 nb = gridDim.x;
        double e = 0.0;
        i64 c = 0;
        block_prefix[0] = 0.0;
        count_prefix[0] = 0;
        for (i64 j = 0; j < nb; ++j) {
            e = __dadd_rn(e, __ldcg(block_sum + j));
            c += __ldcg(block_count + j);
            block_prefix[j + 1] = e;
            count_prefix[j + 1] = c;
        }
        *done = 0u;
    }
}

// Smallest j in [lo, hi) with a[j] > x (hi if none): a is nondecreasing.
__device__ __forceinline__ i64 gear_upper_bound(const double* a, i64 lo, i64 hi, double x) {
    while (lo < hi) {
        const i64 mid = lo + ((hi - lo) >> 1);
        if (a[mid] > x) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// Smallest j in [lo, hi) with a[j] >= x (hi if none).
__device__ __forceinline__ i64 gear_lower_bound(const double* a, i64 lo, i64 hi, double x) {
    while (lo < hi) {
        const i64 mid = lo + ((hi - lo) >> 1);
        if (a[mid] >= x) hi = mid; else lo = mid + 1;
    }
    return lo;
}

__device__ __forceinline__ i64 gear_upper_bound_i64(const i64* a, i64 lo, i64 hi, i64 x) {
    while (lo < hi) {
        const i64 mid = lo + ((hi - lo) >> 1);
        if (a[mid] > x) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// One draw per thread: sample s uses counter0 + s. Prioritized: t = u * total,
// tile j = first with block_prefix[j + 1] > t, slot = first in the tile with
// local_cum > t - block_prefix[j] (clamped to the tile's last positive weight
// when rounding puts t at the very end). Uniform (or all weights zero): the
// floor(u * n_valid)-th valid slot, probability 1 / n_valid.
extern "C" __global__ void __launch_bounds__(256)
gear_weighted_search(const double* __restrict__ priority, const u8* __restrict__ valid, i64 n,
                     double exponent, int mode,
                     const double* __restrict__ local_cum, const double* __restrict__ block_prefix,
                     const i64* __restrict__ count_prefix, i64 nb,
                     u64 seed_state, u64 counter0, i64 batch,
                     i64* __restrict__ out_slots, double* __restrict__ out_prob)
{
    const i64 s = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= batch) return;
    const double total = block_prefix[nb];
    const i64 n_valid = count_prefix[nb];
    if (n_valid <= 0) {
        out_slots[s] = -1;
        out_prob[s] = 0.0;
        return;
    }
    const double u = gear_random_unit(seed_state, counter0 + (u64)s);
    i64 slot;
    double prob;
    if (mode == MODE_UNIFORM || !(total > 0.0)) {
        i64 idx = (i64)__dmul_rn(u, (double)n_valid);
        if (idx >= n_valid) idx = n_valid - 1;
        const i64 j = gear_upper_bound_i64(count_prefix, 1, nb + 1, idx) - 1;
        i64 r = idx - count_prefix[j];
        const i64 lo = j * SCAN_TILE;
        const i64 hi = (lo + SCAN_TILE < n) ? lo + SCAN_TILE : n;
        if (mode == MODE_UNIFORM) {
            // Counts are exact in doubles: the first slot whose count exceeds r.
            slot = gear_upper_bound(local_cum, lo, hi, (double)r);
        } else {
            slot = hi - 1;
            for (i64 i = lo; i < hi; ++i) {
                if (valid[i]) {
                    if (r == 0) { slot = i; break; }
                    --r;
                }
            }
        }
        prob = 1.0 / (double)n_valid;
    } else {
        const double t = __dmul_rn(u, total);
        i64 jp = gear_upper_bound(block_prefix, 1, nb + 1, t);
        if (jp > nb) jp = gear_lower_bound(block_prefix, 1, nb + 1, total);
        const i64 j = jp - 1;
        const double r = __dsub_rn(t, block_prefix[j]);
        const i64 lo = j * SCAN_TILE;
        const i64 hi = (lo + SCAN_TILE < n) ? lo + SCAN_TILE : n;
        slot = gear_upper_bound(local_cum, lo, hi, r);
        if (slot >= hi) slot = gear_lower_bound(local_cum, lo, hi, local_cum[hi - 1]);
        prob = gear_weight(priority[slot], valid[slot], exponent, mode) / total;
    }
    out_slots[s] = slot;
    out_prob[s] = prob;
}

// ---------------------------------------------------------------------------
// Ordered keys: every selection by order (top-k, heaps, FIFO/LIFO, uniform
// without replacement) picks the largest composite keys (k1, k2, k3), compared
// lexicographically. Each mode's last key is unique per slot, so there are no
// ties in the full composite key.
// ---------------------------------------------------------------------------
#define KEY_MAX_PRIORITY 0  // (priority, least recently inserted or updated, lowest slot)
#define KEY_MIN_PRIORITY 1  // (-priority, least recently inserted or updated, lowest slot)
#define KEY_OLDEST 2        // (least insert_seq, lowest slot)
#define KEY_NEWEST 3        // (greatest insert_seq, lowest slot)
#define KEY_RANDOM 4        // (random u64 from (seed, counter0 + slot), lowest slot)

__device__ __forceinline__ u64 gear_order_f64(double p) {
    const u64 b = (u64)__double_as_longlong(p + 0.0);  // -0.0 -> +0.0
    return (b >> 63) ? ~b : (b | 0x8000000000000000ULL);
}

__device__ __forceinline__ u64 gear_order_i64(i64 x) {
    return (u64)x ^ 0x8000000000000000ULL;
}

struct GearKeys {
    u64 k[3];
};

__device__ __forceinline__ GearKeys gear_keys(int mode, i64 i, const double* priority, const i64* insert_seq,
                                              const i64* update_seq, u64 seed_state, u64 counter0) {
    GearKeys r;
    switch (mode) {
        case KEY_MAX_PRIORITY:
            r.k[0] = gear_order_f64(priority[i]);
            r.k[1] = ~gear_order_i64(update_seq[i]);
            r.k[2] = ~(u64)i;
            break;
        case KEY_MIN_PRIORITY:
            r.k[0] = ~gear_order_f64(priority[i]);
            r.k[1] = ~gear_order_i64(update_seq[i]);
            r.k[2] = ~(u64)i;
            break;
        case KEY_OLDEST:
            r.k[0] = ~gear_order_i64(insert_seq[i]);
            r.k[1] = ~(u64)i;
            r.k[2] = 0;
            break;
        case KEY_NEWEST:
            r.k[0] = gear_order_i64(insert_seq[i]);
            r.k[1] = ~(u64)i;
            r.k[2] = 0;
            break;
        default:
            r.k[0] = gear_random_u64(seed_state, counter0 + (u64)i);
            r.k[1] = ~(u64)i;
            r.k[2] = 0;
            break;
    }
    return r;
}

// Radix select state, u64[RS_WORDS] in device memory.
#define RS_PREFIX 0
#define RS_MASK 1
#define RS_REMAINING 2  // how many of the items matching the prefix are still wanted
#define RS_THR0 3       // thresholds found per level (RS_THR0 + level)
#define RS_EQ 6         // items equal to the level's threshold (after its last pass)
#define RS_CANDIDATES 7 // valid slots seen by the first pass
#define RS_WORDS 8
#define RADIX_BITS 8
#define RADIX_BINS 256

// One digit pass (8 bits, most significant first) of the k-th largest search on
// key `level`, among valid slots whose earlier-level keys equal the thresholds
// already found. The last block to finish picks the digit, narrows the prefix
// and clears the histogram for the next pass.
extern "C" __global__ void __launch_bounds__(256)
gear_radix_pass(int mode, int level, int pass, i64 n, const u8* __restrict__ valid,
                const double* __restrict__ priority, const i64* __restrict__ insert_seq,
                const i64* __restrict__ update_seq, u64 seed_state, u64 counter0,
                u64* __restrict__ state, u32* __restrict__ hist, u32* __restrict__ done)
{
    __shared__ u32 s_hist[RADIX_BINS];
    __shared__ bool s_last;
    s_hist[threadIdx.x] = 0;
    __syncthreads();
    const u64 prefix = state[RS_PREFIX];
    const u64 mask = state[RS_MASK];
    const u64 thr0 = state[RS_THR0];
    const u64 thr1 = state[RS_THR0 + 1];
    const int shift = 64 - RADIX_BITS * (pass + 1);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        if (!valid[i]) continue;
        const GearKeys k = gear_keys(mode, i, priority, insert_seq, update_seq, seed_state, counter0);
        if (level >= 1 && k.k[0] != thr0) continue;
        if (level >= 2 && k.k[1] != thr1) continue;
        const u64 key = level == 0 ? k.k[0] : (level == 1 ? k.k[1] : k.k[2]);
        if ((key & mask) != prefix) continue;
        atomicAdd(&s_hist[(u32)(key >> shift) & (RADIX_BINS - 1)], 1u);
    }
    __syncthreads();
    const u32 h = s_hist[threadIdx.x];
    if (h) atomicAdd(&hist[threadIdx.x], h);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = (atomicAdd(done, 1u) == gridDim.x - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const u32 mine = __ldcg(hist + threadIdx.x);
    s_hist[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        const u64 want = state[RS_REMAINING];
        u64 above = 0, seen = 0;
        int digit = 0;
        for (int b = 0; b < RADIX_BINS; ++b) seen += s_hist[b];
        if (level == 0 && pass == 0) state[RS_CANDIDATES] = seen;
        for (int b = RADIX_BINS - 1; b >= 0; --b) {
            if (above + s_hist[b] >= want) { digit = b; break; }
            above += s_hist[b];
        }
        const u64 new_prefix = prefix | ((u64)digit << shift);
        state[RS_REMAINING] = want - above;
        if (pass == 64 / RADIX_BITS - 1) {
            state[RS_THR0 + level] = new_prefix;
            state[RS_EQ] = s_hist[digit];
            state[RS_PREFIX] = 0;
            state[RS_MASK] = 0;
        } else {
            state[RS_PREFIX] = new_prefix;
            state[RS_MASK] = mask | ((u64)(RADIX_BINS - 1) << shift);
        }
        *done = 0u;
    }
    hist[threadIdx.x] = 0u;
}

// Writes every valid slot whose composite key, up to `level`, is greater than
// the thresholds or equal to all of them (the caller has checked that all such
// ties are wanted), with its keys for the final ordering.
extern "C" __global__ void __launch_bounds__(256)
gear_topk_collect(int mode, int level, i64 n, const u8* __restrict__ valid,
                  const double* __restrict__ priority, const i64* __restrict__ insert_seq,
                  const i64* __restrict__ update_seq, u64 seed_state, u64 counter0,
                  const u64* __restrict__ state, i64 capacity, u32* __restrict__ count,
                  i64* __restrict__ out_slots, u64* __restrict__ out_keys)  // out_keys [3, capacity]
{
    const u64 t0 = state[RS_THR0], t1 = state[RS_THR0 + 1], t2 = state[RS_THR0 + 2];
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        if (!valid[i]) continue;
        const GearKeys k = gear_keys(mode, i, priority, insert_seq, update_seq, seed_state, counter0);
        bool take;
        if (k.k[0] != t0 || level == 0) take = k.k[0] >= t0;
        else if (k.k[1] != t1 || level == 1) take = k.k[1] >= t1;
        else take = k.k[2] >= t2;
        if (!take) continue;
        const u32 at = atomicAdd(count, 1u);
        if ((i64)at < capacity) {
            out_slots[at] = i;
            out_keys[at] = k.k[0];
            out_keys[capacity + at] = k.k[1];
            out_keys[2 * capacity + at] = k.k[2];
        }
    }
}

// The single best slot by composite key (heaps, FIFO, LIFO); -1 when none is valid.
// Per-block winners go to `partial` ([gridDim.x] x 4 u64: k0, k1, k2, slot+1);
// the last block reduces them.
__device__ __forceinline__ bool gear_better(u64 a0, u64 a1, u64 a2, u64 b0, u64 b1, u64 b2) {
    if (a0 != b0) return a0 > b0;
    if (a1 != b1) return a1 > b1;
    return a2 > b2;
}

extern "C" __global__ void __launch_bounds__(256)
gear_argbest(int mode, i64 n, const u8* __restrict__ valid, const double* __restrict__ priority,
             const i64* __restrict__ insert_seq, const i64* __restrict__ update_seq,
             u64* __restrict__ partial, u32* __restrict__ done, i64* __restrict__ out_slot)
{
    __shared__ u64 s_k[3][256];
    __shared__ u64 s_slot[256];
    __shared__ bool s_last;
    u64 b0 = 0, b1 = 0, b2 = 0, bs = 0;  // bs = slot + 1; 0 = none
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        if (!valid[i]) continue;
        const GearKeys k = gear_keys(mode, i, priority, insert_seq, update_seq, 0, 0);
        if (bs == 0 || gear_better(k.k[0], k.k[1], k.k[2], b0, b1, b2)) {
            b0 = k.k[0]; b1 = k.k[1]; b2 = k.k[2]; bs = (u64)i + 1;
        }
    }
    s_k[0][threadIdx.x] = b0; s_k[1][threadIdx.x] = b1; s_k[2][threadIdx.x] = b2; s_slot[threadIdx.x] = bs;
    __syncthreads();
    for (int stride = 128; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const int o = threadIdx.x + stride;
            if (s_slot[o] && (!s_slot[threadIdx.x] ||
                              gear_better(s_k[0][o], s_k[1][o], s_k[2][o],
                                          s_k[0][threadIdx.x], s_k[1][threadIdx.x], s_k[2][threadIdx.x]))) {
                s_k[0][threadIdx.x] = s_k[0][o]; s_k[1][threadIdx.x] = s_k[1][o];
                s_k[2][threadIdx.x] = s_k[2][o]; s_slot[threadIdx.x] = s_slot[o];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        u64* p = partial + 4 * (u64)blockIdx.x;
        p[0] = s_k[0][0]; p[1] = s_k[1][0]; p[2] = s_k[2][0]; p[3] = s_slot[0];
        __threadfence();
        s_last = (atomicAdd(done, 1u) == gridDim.x - 1);
    }
    __syncthreads();
    if (!s_last || threadIdx.x != 0) return;
    __threadfence();
    u64 c0 = 0, c1 = 0, c2 = 0, cs = 0;
    for (u32 j = 0; j < gridDim.x; ++j) {
        const u64* p = partial + 4 * (u64)j;
        const u64 ps = __ldcg(p + 3);
        if (!ps) continue;
        const u64 p0 = __ldcg(p), p1 = __ldcg(p + 1), p2 = __ldcg(p + 2);
        if (!cs || gear_better(p0, p1, p2, c0, c1, c2)) { c0 = p0; c1 = p1; c2 = p2; cs = ps; }
    }
    *out_slot = (i64)cs - 1;
    *done = 0u;
}

// ---------------------------------------------------------------------------
// Batched metadata writes. Duplicate slots in one batch: the last entry wins,
// as with NumPy's a[idx] = v. Pass 0 claims each slot for its last entry
// (atomicMax of (epoch << 32 | entry) in `winner`, a u64 per slot that is never
// cleared: a fresh epoch per batch outranks every older claim); pass 1 writes
// the claimed entries.
// ---------------------------------------------------------------------------
#define FIELD_PRIORITY 1
#define FIELD_UPDATE_SEQ 2
#define FIELD_INSERT_SEQ 4
#define FIELD_VALID 8
#define FIELD_TIMES_SAMPLED 16

extern "C" __global__ void __launch_bounds__(256)
gear_scatter(int pass, int fields, const i64* __restrict__ slots, i64 count, i64 n, u64 epoch,
             u64* __restrict__ winner,
             const double* __restrict__ new_priority, const i64* __restrict__ new_update_seq,
             const i64* __restrict__ new_insert_seq, const u8* __restrict__ new_valid,
             const i32* __restrict__ new_times_sampled,
             double* __restrict__ priority, i64* __restrict__ update_seq, i64* __restrict__ insert_seq,
             u8* __restrict__ valid, i32* __restrict__ times_sampled)
{
    const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= count) return;
    const i64 slot = slots[e];
    if (slot < 0 || slot >= n) return;
    const u64 tag = (epoch << 32) | (u64)e;
    if (pass == 0) {
        atomicMax(winner + slot, tag);
        return;
    }
    if (winner[slot] != tag) return;
    if (fields & FIELD_PRIORITY) priority[slot] = new_priority[e];
    if (fields & FIELD_UPDATE_SEQ) update_seq[slot] = new_update_seq[e];
    if (fields & FIELD_INSERT_SEQ) insert_seq[slot] = new_insert_seq[e];
    if (fields & FIELD_VALID) valid[slot] = new_valid[e];
    if (fields & FIELD_TIMES_SAMPLED) times_sampled[slot] = new_times_sampled[e];
}

// times_sampled[slot] += 1 per occurrence (a slot drawn twice counts twice).
extern "C" __global__ void __launch_bounds__(256)
gear_increment_times_sampled(const i64* __restrict__ slots, i64 count, i64 n, i32* __restrict__ times_sampled)
{
    const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= count) return;
    const i64 slot = slots[e];
    if (slot >= 0 && slot < n) atomicAdd(times_sampled + slot, 1);
}
