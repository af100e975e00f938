// Selection kernels (prioritized and uniform draws) and batched metadata writes
// over per-slot arrays (priority f64, valid u8, insert_seq i64, update_seq i64).
//
// Every kernel has a NumPy twin in gear_kernels/twins.py with the same semantics;
// where the arithmetic is the same IEEE operations in the same order, the twin
// gives bit-identical results (see docs/KERNELS.md).
#include "gear_common.cuh"

#define MODE_PRIORITIZED 0
#define MODE_UNIFORM 1

// ---------------------------------------------------------------------------
// Weights and their cumulative sums, in three levels.
//
// Tile j covers slots [j * TILE, (j + 1) * TILE). Inside a tile, thread m owns
// the subtile {tile0 + k * 256 + m : k = 0..15} (so the loads of a warp are
// coalesced), and the tile's canonical order is subtile by subtile, k within a
// subtile. Every cumulative value is a left fold in that order: a thread folds
// its 16 weights, thread 0 folds the 256 subtile totals (sub_prefix holds each
// subtile's exclusive prefix), and the last tile to finish folds the tile sums
// into block_prefix[nb + 1] (and the valid counts into count_prefix). Left
// folds make every level monotone, so a draw never lands on a zero weight.
// Only the subtile prefixes are written (N / 16 values); the search refolds
// the 16 weights of the one subtile a draw lands in.
// ---------------------------------------------------------------------------
#define SCAN_THREADS 256
#define SCAN_ITEMS 16
#define SCAN_TILE (SCAN_THREADS * SCAN_ITEMS)
#define FOLD_CHUNK 1024
#define SEARCH_THREADS 64         // small blocks: a batch of a few thousand draws spreads over every SM
#define SEARCH_SMEM_PREFIX 1025   // tile prefixes staged in shared memory by the search (tables up to 4M slots)

__device__ __forceinline__ double gear_weight(double p, u8 valid, double exponent, int mode) {
    if (!valid) return 0.0;
    if (mode == MODE_UNIFORM) return 1.0;
    if (!(p > 0.0)) return 0.0;  // priority 0 has weight 0, even for exponent 0
    if (exponent == 1.0) return p;
    if (exponent == 0.0) return 1.0;
    // exp(e * log p): within a few ulps of pow(p, e) (the weights feed a sampler,
    // not an identity), at a fraction of pow's cost.
    return exp(exponent * log(p));
}

__device__ __forceinline__ double gear_weight_at(const double* priority, const u8* valid, i64 i, i64 n,
                                                 double exponent, int mode) {
    if (i >= n) return 0.0;
    return gear_weight(mode == MODE_UNIFORM ? 0.0 : priority[i], valid[i], exponent, mode);
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
gear_weight_scan(const double* __restrict__ priority, const u8* __restrict__ valid, i64 n,
                 double exponent, int mode,
                 double* __restrict__ sub_prefix,    // [nb * 256]
                 double* __restrict__ block_sum,     // [nb]
                 i64* __restrict__ block_count,      // [nb]
                 double* __restrict__ block_prefix,  // [nb + 1]
                 i64* __restrict__ count_prefix,     // [nb + 1]
                 u32* __restrict__ done)             // [1], zero between launches
{
    __shared__ double s_total[SCAN_THREADS];
    __shared__ i32 s_count[SCAN_THREADS];
    __shared__ double s_excl[SCAN_THREADS];
    __shared__ double s_bs[FOLD_CHUNK];
    __shared__ i64 s_bc[FOLD_CHUNK];
    __shared__ bool s_last;

    const i64 tile0 = (i64)blockIdx.x * SCAN_TILE;
    double w[SCAN_ITEMS];
    u8 v[SCAN_ITEMS];
#pragma unroll
    for (int k = 0; k < SCAN_ITEMS; ++k) {  // all loads first: 16 in flight per thread
        const i64 i = tile0 + (i64)k * SCAN_THREADS + threadIdx.x;
        v[k] = i < n ? valid[i] : (u8)0;
        w[k] = (i < n && mode != MODE_UNIFORM) ? priority[i] : 0.0;
    }
    double acc = 0.0;
    i32 cnt = 0;
#pragma unroll
    for (int k = 0; k < SCAN_ITEMS; ++k) {
        acc = __dadd_rn(acc, gear_weight(w[k], v[k], exponent, mode));
        cnt += (v[k] != 0);
    }
    s_total[threadIdx.x] = acc;
    s_count[threadIdx.x] = cnt;
    __syncthreads();
    if (threadIdx.x == 0) {
        // A left fold: serial by definition, so the loads of each group of 8 go first.
        double e = 0.0;
        i64 c = 0;
        for (int t = 0; t < SCAN_THREADS; t += 8) {
            double tv[8];
            i32 cc[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) { tv[q] = s_total[t + q]; cc[q] = s_count[t + q]; }
#pragma unroll
            for (int q = 0; q < 8; ++q) { s_excl[t + q] = e; e = __dadd_rn(e, tv[q]); c += cc[q]; }
        }
        block_sum[blockIdx.x] = e;
        block_count[blockIdx.x] = c;
    }
    __syncthreads();
    sub_prefix[(i64)blockIdx.x * SCAN_THREADS + threadIdx.x] = s_excl[threadIdx.x];

    // The last tile to finish folds the tile sums (the classic fence + counter pattern).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = (atomicAdd(done, 1u) == gridDim.x - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const i64 nb = gridDim.x;
    double e = 0.0;
    i64 c = 0;
    if (threadIdx.x == 0) { block_prefix[0] = 0.0; count_prefix[0] = 0; }
    for (i64 j0 = 0; j0 < nb; j0 += FOLD_CHUNK) {
        __syncthreads();
        for (int q = threadIdx.x; q < FOLD_CHUNK; q += SCAN_THREADS) {
            const i64 j = j0 + q;
            s_bs[q] = j < nb ? __ldcg(block_sum + j) : 0.0;
            s_bc[q] = j < nb ? __ldcg(block_count + j) : 0;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const i64 m = (nb - j0 < FOLD_CHUNK) ? nb - j0 : FOLD_CHUNK;
            for (int q = 0; q < m; q += 8) {
                double bv[8];
                i64 cc[8];
#pragma unroll
                for (int r = 0; r < 8; ++r) { bv[r] = s_bs[q + r]; cc[r] = s_bc[q + r]; }
#pragma unroll
                for (int r = 0; r < 8; ++r) {
                    e = __dadd_rn(e, bv[r]);
                    c += cc[r];
                    if (q + r < m) { block_prefix[j0 + q + r + 1] = e; count_prefix[j0 + q + r + 1] = c; }
                }
            }
        }
    }
    if (threadIdx.x == 0) *done = 0u;
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

// Subtile m's inclusive cumulative value in tile coordinates: the next
// subtile's exclusive prefix, or the tile sum for the last one.
__device__ __forceinline__ double gear_sub_incl(const double* E, double tile_sum, int m) {
    return m < SCAN_THREADS - 1 ? E[m + 1] : tile_sum;
}

// One draw per thread: draw s uses counter counter0 + s. Prioritized: t = u * total;
// tile j = first with block_prefix[j + 1] > t; subtile m = first whose inclusive
// value exceeds r = t - block_prefix[j]; slot = first of its 16 whose value
// sub_prefix + fold exceeds r. Where rounding puts r at or past the end of a
// level, the first item reaching that level's end is taken (it has a positive
// weight). Uniform: the same search over counts with t = floor(u * n_valid), the
// t-th valid slot in canonical order. All weights zero: the floor(u * n_valid)-th
// valid slot, found by counting. Probabilities: w / total, or 1 / n_valid.
extern "C" __global__ void __launch_bounds__(SEARCH_THREADS)
gear_weighted_search(const double* __restrict__ priority, const u8* __restrict__ valid, i64 n,
                     double exponent, int mode,
                     const double* __restrict__ sub_prefix, const double* __restrict__ block_sum,
                     const double* __restrict__ block_prefix, const i64* __restrict__ count_prefix, i64 nb,
                     u64 seed_state, u64 counter0, const u64* __restrict__ rng_params, i64 batch,
                     i64* __restrict__ out_slots, double* __restrict__ out_prob)
{
    __shared__ double s_prefix[SEARCH_SMEM_PREFIX];
    const double* prefix = block_prefix;
    if (nb + 1 <= SEARCH_SMEM_PREFIX) {
        for (i64 j = threadIdx.x; j <= nb; j += blockDim.x) s_prefix[j] = block_prefix[j];
        __syncthreads();
        prefix = s_prefix;
    }
    const i64 s = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= batch) return;
    if (rng_params) {  // a replayed CUDA graph passes its draws' seed and counter in device memory
        seed_state = rng_params[0];
        counter0 = rng_params[1];
    }
    const double total = prefix[nb];
    const i64 n_valid = count_prefix[nb];
    if (n_valid <= 0) {
        out_slots[s] = -1;
        out_prob[s] = 0.0;
        return;
    }
    const double u = gear_random_unit(seed_state, counter0 + (u64)s);
    const bool fallback = mode != MODE_UNIFORM && !(total > 0.0);
    i64 idx = 0;
    if (mode == MODE_UNIFORM || fallback) {
        idx = (i64)__dmul_rn(u, (double)n_valid);
        if (idx >= n_valid) idx = n_valid - 1;
    }
    i64 slot;
    double prob;
    if (fallback) {
        // Every weight is zero: the idx-th valid slot in canonical order, by counting.
        const i64 j = gear_upper_bound_i64(count_prefix, 1, nb + 1, idx) - 1;
        i64 r = idx - count_prefix[j];
        const i64 tile0 = j * SCAN_TILE;
        slot = -1;
        for (int m = 0; m < SCAN_THREADS && slot < 0; ++m) {
            for (int k = 0; k < SCAN_ITEMS; ++k) {
                const i64 i = tile0 + (i64)k * SCAN_THREADS + m;
                if (i < n && valid[i]) {
                    if (r == 0) { slot = i; break; }
                    --r;
                }
            }
        }
        prob = 1.0 / (double)n_valid;
    } else {
        const double t = mode == MODE_UNIFORM ? (double)idx : __dmul_rn(u, total);
        i64 jp = gear_upper_bound(prefix, 1, nb + 1, t);
        if (jp > nb) jp = gear_lower_bound(prefix, 1, nb + 1, total);
        const i64 j = jp - 1;
        const double r = __dsub_rn(t, prefix[j]);
        const double tile_sum = block_sum[j];
        const double* E = sub_prefix + j * SCAN_THREADS;
        // First subtile m whose inclusive value exceeds r (or, when rounding puts r at
        // or past the tile's end, reaches the end): two rounds of 16 independent loads,
        // groups of 16 subtiles first, then the subtiles of the group.
        const bool past_end = !(tile_sum > r);
        double g[16];
#pragma unroll
        for (int q = 0; q < 16; ++q) g[q] = gear_sub_incl(E, tile_sum, 16 * q + 15);
        int group = 15;
#pragma unroll
        for (int q = 15; q >= 0; --q)
            if (past_end ? g[q] >= tile_sum : g[q] > r) group = q;
        double h[16];
#pragma unroll
        for (int q = 0; q < 16; ++q) h[q] = gear_sub_incl(E, tile_sum, 16 * group + q);
        int within = 15;
#pragma unroll
        for (int q = 15; q >= 0; --q)
            if (past_end ? h[q] >= tile_sum : h[q] > r) within = q;
        const int m = 16 * group + within;
        const double e = E[m];
        const i64 tile0 = j * SCAN_TILE;
        double w[SCAN_ITEMS];
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; ++k)
            w[k] = gear_weight_at(priority, valid, tile0 + (i64)k * SCAN_THREADS + m, n, exponent, mode);
        double c = 0.0, val_end;
        int chosen = -1;
        double vals[SCAN_ITEMS];
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; ++k) {
            c = __dadd_rn(c, w[k]);
            vals[k] = __dadd_rn(e, c);
            if (chosen < 0 && vals[k] > r) chosen = k;
        }
        val_end = vals[SCAN_ITEMS - 1];
        if (chosen < 0) {  // r at or past the subtile's end: the first item reaching it
#pragma unroll
            for (int k = SCAN_ITEMS - 1; k >= 0; --k)
                if (vals[k] >= val_end) chosen = k;
        }
        double wc = 0.0;
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; ++k)
            if (k == chosen) wc = w[k];
        slot = tile0 + (i64)chosen * SCAN_THREADS + m;
        prob = mode == MODE_UNIFORM ? 1.0 / (double)n_valid : wc / total;
    }
    out_slots[s] = slot;
    out_prob[s] = prob;
}

// ---------------------------------------------------------------------------
// Batched metadata writes. Duplicate slots in one batch: the last entry wins,
// as with NumPy's a[idx] = v. Each entry first claims its slot (atomicMax of
// (epoch << 32 | entry) in `winner`, a u64 per slot that is never cleared: a
// fresh epoch per batch outranks every older claim), then the claimed entries
// are written. mode 2 does both in one launch (the last block to finish its
// claims writes every entry: for batches up to tens of thousands); modes 0
// and 1 are the two halves, as two launches, for larger batches.
// ---------------------------------------------------------------------------
#define FIELD_PRIORITY 1
#define FIELD_UPDATE_SEQ 2
#define FIELD_INSERT_SEQ 4
#define FIELD_VALID 8
#define FIELD_TIMES_SAMPLED 16

__device__ __forceinline__ void gear_write_claimed(i64 e, int fields, const i64* slots, i64 n, u64 epoch,
                                                   const u64* winner, const double* new_priority,
                                                   const i64* new_update_seq, const i64* new_insert_seq,
                                                   const u8* new_valid, const i32* new_times_sampled,
                                                   double* priority, i64* update_seq, i64* insert_seq,
                                                   u8* valid, i32* times_sampled) {
    const i64 slot = slots[e];
    if (slot < 0 || slot >= n) return;
    if (__ldcg(winner + slot) != ((epoch << 32) | (u64)e)) return;
    if (fields & FIELD_PRIORITY) priority[slot] = new_priority[e];
    if (fields & FIELD_UPDATE_SEQ) update_seq[slot] = new_update_seq[e];
    if (fields & FIELD_INSERT_SEQ) insert_seq[slot] = new_insert_seq[e];
    if (fields & FIELD_VALID) valid[slot] = new_valid[e];
    if (fields & FIELD_TIMES_SAMPLED) times_sampled[slot] = new_times_sampled[e];
}

extern "C" __global__ void __launch_bounds__(256)
gear_scatter(int mode, int fields, const i64* __restrict__ slots, i64 count, i64 n, u64 epoch,
             u64* __restrict__ winner,
             const double* __restrict__ new_priority, const i64* __restrict__ new_update_seq,
             const i64* __restrict__ new_insert_seq, const u8* __restrict__ new_valid,
             const i32* __restrict__ new_times_sampled,
             double* __restrict__ priority, i64* __restrict__ update_seq, i64* __restrict__ insert_seq,
             u8* __restrict__ valid, i32* __restrict__ times_sampled, u32* __restrict__ done,
             const u64* __restrict__ epoch_param)
{
    __shared__ bool s_last;
    if (epoch_param) epoch = *epoch_param;  // a replayed CUDA graph passes the epoch in device memory
    const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (mode == 1) {
        if (e < count)
            gear_write_claimed(e, fields, slots, n, epoch, winner, new_priority, new_update_seq, new_insert_seq,
                               new_valid, new_times_sampled, priority, update_seq, insert_seq, valid, times_sampled);
        return;
    }
    if (e < count) {
        const i64 slot = slots[e];
        if (slot >= 0 && slot < n) atomicMax(winner + slot, (epoch << 32) | (u64)e);
    }
    if (mode == 0) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = (atomicAdd(done, 1u) == gridDim.x - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (i64 f = threadIdx.x; f < count; f += blockDim.x)
        gear_write_claimed(f, fields, slots, n, epoch, winner, new_priority, new_update_seq, new_insert_seq,
                           new_valid, new_times_sampled, priority, update_seq, insert_seq, valid, times_sampled);
    if (threadIdx.x == 0) *done = 0u;
}
