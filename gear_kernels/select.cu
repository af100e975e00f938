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
    // Suffix sums over the bins (inclusive: bins >= b); the one bin where the
    // wanted count falls is the digit.
    __shared__ u64 s_suf[RADIX_BINS];
    const u64 want = state[RS_REMAINING];
    const u64 mine = __ldcg(hist + threadIdx.x);
    s_suf[threadIdx.x] = mine;
    __syncthreads();
    for (int off = 1; off < RADIX_BINS; off <<= 1) {
        const u64 add = (threadIdx.x + off < RADIX_BINS) ? s_suf[threadIdx.x + off] : 0;
        __syncthreads();
        s_suf[threadIdx.x] += add;
        __syncthreads();
    }
    const u64 incl = s_suf[threadIdx.x];
    const u64 above = incl - mine;
    if (threadIdx.x == 0 && level == 0 && pass == 0) state[RS_CANDIDATES] = s_suf[0];
    if (above < want && want <= incl) {
        const u64 new_prefix = prefix | ((u64)threadIdx.x << shift);
        state[RS_REMAINING] = want - above;
        if (pass == 64 / RADIX_BITS - 1) {
            state[RS_THR0 + level] = new_prefix;
            state[RS_EQ] = mine;
            state[RS_PREFIX] = 0;
            state[RS_MASK] = 0;
        } else {
            state[RS_PREFIX] = new_prefix;
            state[RS_MASK] = mask | ((u64)(RADIX_BINS - 1) << shift);
        }
    }
    hist[threadIdx.x] = 0u;
    if (threadIdx.x == 0) *done = 0u;
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

// Block-wide best of each thread's candidate (bs = slot + 1, 0 = none); the
// winner ends in s_k[.][0], s_slot[0]. blockDim.x must be 256.
__device__ __forceinline__ void gear_block_best(u64 (*s_k)[256], u64* s_slot, u64 b0, u64 b1, u64 b2, u64 bs) {
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
    gear_block_best(s_k, s_slot, b0, b1, b2, bs);
    if (threadIdx.x == 0) {
        u64* p = partial + 4 * (u64)blockIdx.x;
        p[0] = s_k[0][0]; p[1] = s_k[1][0]; p[2] = s_k[2][0]; p[3] = s_slot[0];
        __threadfence();
        s_last = (atomicAdd(done, 1u) == gridDim.x - 1);
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    u64 c0 = 0, c1 = 0, c2 = 0, cs = 0;
    for (u32 j = threadIdx.x; j < gridDim.x; j += blockDim.x) {
        const u64* p = partial + 4 * (u64)j;
        const u64 ps = __ldcg(p + 3);
        if (!ps) continue;
        const u64 p0 = __ldcg(p), p1 = __ldcg(p + 1), p2 = __ldcg(p + 2);
        if (!cs || gear_better(p0, p1, p2, c0, c1, c2)) { c0 = p0; c1 = p1; c2 = p2; cs = ps; }
    }
    __syncthreads();
    gear_block_best(s_k, s_slot, c0, c1, c2, cs);
    if (threadIdx.x == 0) {
        *out_slot = (i64)s_slot[0] - 1;
        *done = 0u;
    }
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

// times_sampled[slot] += 1 per occurrence (a slot drawn twice counts twice).
extern "C" __global__ void __launch_bounds__(256)
gear_increment_times_sampled(const i64* __restrict__ slots, i64 count, i64 n, i32* __restrict__ times_sampled)
{
    const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= count) return;
    const i64 slot = slots[e];
    if (slot >= 0 && slot < n) atomicAdd(times_sampled + slot, 1);
}
