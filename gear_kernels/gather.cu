// Collection: gather item windows from mapped host memory (a table segment
// registered with cudaHostRegister) into one contiguous device buffer,
// [B, window, *shape] per column, writing the padding and the valid lengths.
//
// One launch covers a batch and a group of columns: block (x, y) handles chunk
// x % chunks of item x / chunks of column y. A chunk is UNITS_PER_BLOCK
// 16-byte units of the destination row, aligned in absolute address so every
// full unit is one 16-byte store. A unit whose source is 16-byte aligned too
// (the usual case: slots and columns are 128-byte aligned) is one 16-byte
// load; otherwise the unit loads the (at most two) aligned 16-byte words that
// hold its source bytes and shifts them into place, so any alignment is
// correct. Bytes outside the item's valid steps are written as zeros. All
// offsets are 64-bit.
#include "gear_common.cuh"

#define GATHER_THREADS 256
#define UNITS_PER_THREAD 4
#define UNITS_PER_BLOCK (GATHER_THREADS * UNITS_PER_THREAD)

// Matches GATHER_COLUMN_DTYPE in kernels/gather.py (64 bytes).
struct GatherColumn {
    u64 src_offset;    // byte offset of slot 0 of this column within the segment
    u64 slot_stride;   // bytes between consecutive slots
    u64 out_offset;    // byte offset of this column's [B, window, ...] block in `out`
    i64 step_bytes;    // bytes per step
    i32 window;        // steps per output row
    i32 max_length;    // steps a slot holds (lengths are clamped to it)
    i32 start;         // window start when start_row < 0: >= 0 from the item's first step, < 0 from its end
    i32 pad_head;      // 1: valid steps end the row (padding first); 0: valid steps start it
    i32 length_column; // column of `lengths` holding this column's item lengths
    i32 start_row;     // row of `starts` ([rows, B]) holding per-item window starts, or -1
    i32 reserved0;
    i32 reserved1;
};

// Word `idx` (0..8) of the 32-byte source window held in v0..v7; 8 -> 0.
__device__ __forceinline__ u32 gear_pick(u32 v0, u32 v1, u32 v2, u32 v3, u32 v4, u32 v5, u32 v6, u32 v7, int idx) {
    u32 r = 0;
    r = (idx == 0) ? v0 : r;
    r = (idx == 1) ? v1 : r;
    r = (idx == 2) ? v2 : r;
    r = (idx == 3) ? v3 : r;
    r = (idx == 4) ? v4 : r;
    r = (idx == 5) ? v5 : r;
    r = (idx == 6) ? v6 : r;
    r = (idx == 7) ? v7 : r;
    return r;
}

__device__ __forceinline__ u32 gear_byte_mask(u32 bits4) {
    return ((bits4 & 1u) ? 0x000000ffu : 0u) | ((bits4 & 2u) ? 0x0000ff00u : 0u) |
           ((bits4 & 4u) ? 0x00ff0000u : 0u) | ((bits4 & 8u) ? 0xff000000u : 0u);
}

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gear_gather(const u8* __restrict__ segment, u64 capacity, const GatherColumn* __restrict__ columns,
            const i64* __restrict__ slots, const i32* __restrict__ lengths, i32 lengths_stride,
            const i64* __restrict__ starts, i64 batch, i64 chunks,
            u8* __restrict__ out, i32* __restrict__ out_lengths)
{
    const i64 item = (i64)blockIdx.x / chunks;
    const i64 chunk = (i64)blockIdx.x % chunks;
    const int c = blockIdx.y;
    if (item >= batch) return;
    const GatherColumn col = columns[c];
    const i64 step = col.step_bytes;
    const i64 W = col.window;
    const i64 slot = slots[item];
    const bool slot_ok = slot >= 0 && (u64)slot < capacity;

    i64 L = slot_ok ? (i64)lengths[item * lengths_stride + col.length_column] : 0;
    L = L < 0 ? 0 : (L > col.max_length ? (i64)col.max_length : L);
    const i64 start = col.start_row >= 0 ? starts[(i64)col.start_row * batch + item] : (i64)col.start;
    const i64 s0 = start >= 0 ? start : L + start;        // item step at window position 0
    const i64 src_first = s0 > 0 ? s0 : 0;
    const i64 src_end = (s0 + W < L) ? s0 + W : L;
    const i64 nvalid = src_end > src_first ? src_end - src_first : 0;
    const i64 dst_first = col.pad_head ? W - nvalid : 0;
    if (chunk == 0 && threadIdx.x == 0) out_lengths[item * gridDim.y + c] = slot_ok ? (i32)nvalid : -1;

    const u64 row_bytes = (u64)(W * step);
    const u64 D = (u64)out + col.out_offset + (u64)item * row_bytes;  // destination row [D, D + row_bytes)
    const u64 DE = D + row_bytes;
    const u64 VA = D + (u64)(dst_first * step);                       // valid bytes [VA, VB)
    const u64 VB = VA + (u64)(nvalid * step);
    // Source address of destination byte x (for x in [VA, VB)) is x + delta.
    const u64 src_valid = (u64)segment + col.src_offset + (u64)slot * col.slot_stride + (u64)(src_first * step);
    const u64 delta = src_valid - VA;  // modular arithmetic: fine for unsigned
    const u64 U0 = D & ~(u64)15;
    const u64 nunits = (((DE + 15) & ~(u64)15) - U0) >> 4;
    const u64 first_unit = (u64)chunk * UNITS_PER_BLOCK;
    if (first_unit >= nunits) return;
    const u32 shift = (u32)((U0 + delta) & 15);  // source misalignment, the same for every unit of the row

    uint4 w0[UNITS_PER_THREAD], w1[UNITS_PER_THREAD];
    u32 vmask[UNITS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 u = first_unit + (u64)k * GATHER_THREADS + threadIdx.x;
        w0[k] = make_uint4(0, 0, 0, 0);
        w1[k] = make_uint4(0, 0, 0, 0);
        vmask[k] = 0;
        if (u >= nunits) continue;
        const u64 X = U0 + (u << 4);
        const i64 lo = (i64)(VA > X ? VA - X : 0);
        const i64 hi = (i64)(VB > X ? (VB - X < 16 ? VB - X : 16) : 0);
        if (hi <= lo) continue;
        vmask[k] = ((1u << hi) - 1u) & ~((1u << lo) - 1u);
        const u64 S = X + delta;         // source of byte 0 of this unit (only used where valid)
        const u64 A = S & ~(u64)15;
        if ((i64)shift + lo < 16) w0[k] = *reinterpret_cast<const uint4*>(A);
        if ((i64)shift + hi - 1 >= 16) w1[k] = *reinterpret_cast<const uint4*>(A + 16);
    }
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 u = first_unit + (u64)k * GATHER_THREADS + threadIdx.x;
        if (u >= nunits) continue;
        const u64 X = U0 + (u << 4);
        uint4 d;
        if (shift == 0) {
            d = w0[k];
        } else {
            const int q = (int)(shift >> 2);
            const u32 rb = (shift & 3u) * 8u;
            const uint4 a = w0[k], b = w1[k];
            u32 o[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 lo_w = gear_pick(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w, q + j);
                const u32 hi_w = gear_pick(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w, q + j + 1);
                o[j] = __funnelshift_r(lo_w, hi_w, rb);
            }
            d = make_uint4(o[0], o[1], o[2], o[3]);
        }
        const u32 m = vmask[k];
        if (m != 0xffffu) {
            d.x &= gear_byte_mask(m);
            d.y &= gear_byte_mask(m >> 4);
            d.z &= gear_byte_mask(m >> 8);
            d.w &= gear_byte_mask(m >> 12);
        }
        if (X >= D && X + 16 <= DE) {
            *reinterpret_cast<uint4*>(X) = d;
        } else {
            // Row edge: write only this row's bytes (the rest belong to neighbours).
            const u32 dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const u64 x = X + j;
                if (x >= D && x < DE) *reinterpret_cast<u8*>(x) = (u8)(dw[j / 4] >> (8 * (j % 4)));
            }
        }
    }
}
