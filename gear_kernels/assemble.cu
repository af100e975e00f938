// Assembly of a sharded batch: every shard's rows copied into one device batch in one launch
// (gear_client/sharding/assembly.py builds the task table: per output row, source, destination,
// bytes to copy and the row's bytes; the rest of the row is zeroed).
template <typename T>
__device__ __forceinline__ void copy_span(const char* src, char* dst, long long copy, long long begin,
                                          long long end) {
    for (long long i = begin + (long long)threadIdx.x * (long long)sizeof(T); i < end;
         i += (long long)blockDim.x * (long long)sizeof(T)) {
        T v = T();
        if (i < copy) v = *reinterpret_cast<const T*>(src + i);
        *reinterpret_cast<T*>(dst + i) = v;
    }
}

// One task per output row: copy `copy` bytes from src, zero the row's bytes after them.
extern "C" __global__ void gear_assemble_rows(const long long* __restrict__ tasks, long long num_tasks,
                                              long long blocks_per_task, long long block_bytes) {
    long long task = (long long)blockIdx.x / blocks_per_task;
    if (task >= num_tasks) return;
    long long begin = ((long long)blockIdx.x - task * blocks_per_task) * block_bytes;
    const long long* t = tasks + 4 * task;
    long long row = t[3];
    if (begin >= row) return;
    long long end = begin + block_bytes < row ? begin + block_bytes : row;
    const char* src = reinterpret_cast<const char*>(t[0]);
    char* dst = reinterpret_cast<char*>(t[1]);
    long long copy = t[2];
    unsigned long long align = (unsigned long long)t[0] | (unsigned long long)t[1] | (unsigned long long)copy
                               | (unsigned long long)row;
    if ((align & 15) == 0) copy_span<uint4>(src, dst, copy, begin, end);
    else if ((align & 7) == 0) copy_span<unsigned long long>(src, dst, copy, begin, end);
    else if ((align & 3) == 0) copy_span<unsigned int>(src, dst, copy, begin, end);
    else copy_span<unsigned char>(src, dst, copy, begin, end);
}
