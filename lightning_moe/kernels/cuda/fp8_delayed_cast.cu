// The delayed-scaling float8 cast of `fp8_delayed_triton.delayed_cast` for bf16 operands, plain or
// gathered through a permutation, into the per-group transposed copy (q_col at strides stride_qc and
// stride_qg, shifted into the aligned group layout of aligned_ends with ALIGN) with its scales s_col [G, C],
// and the row copy: the same bytes as the Triton tile kernel (`_delayed_cast_kernel`), in fewer
// instructions per element.
//
// Why CUDA C: the Triton cast issues ~12 thread instructions per
// element at two 4-warp programs per multiprocessor (255 registers, spills), and reaches ~65% of a copy's
// bandwidth. Here a thread owns an 8-row x 8-column chunk: it loads 8 rows of 16 bytes (all in flight at
// once), casts them, stores the row copy 8 bytes a row, and transposes the float8 bytes in registers
// (`prmt`, no shared memory) so that each of its 8 columns goes out as one 8-byte store of 8 consecutive
// rows. A warp is 4 chunks of rows x 8 of columns (32 rows x 64 columns): each row read is one 128-byte
// line, each transposed column one 32-byte sector. Gathered rows' token indices come one per lane, loaded
// a pass ahead, and reach the lanes that read the rows by shuffle.
//
// Compiled at run time by NVRTC (`kernels/cuda_launch.py`) with these macros:
//   GATHER     1: x is [T, C]; operand row r is x[src[r]], zeros where src[r] == T (a padding row)
//   WRITE_ROW  1: write the row copy q_row [R, C] and its scales s_row [R]
//   RECORD     1: max-fold each group's amax into record [G]
//   ALIGN      0, or the aligned group layout's alignment (`WGRAD_GROUP_ALIGN`): shift each group's
//              transposed rows to aligned_ends[g - 1] and zero the gap after them
// and the launch's MIN_BLOCKS (register cap, `fp8_cast_cuda.MIN_BLOCKS`) and WARPS_ACROSS.
//
// Grid (ceil(C / BLOCK_COLS), groups (+1 with WRITE_ROW: the tail group, rows past the last end, scale 1, row
// copy only)), 128 threads. The numbers follow the Triton kernel exactly: fp32 product x * scale rounded to
// nearest, saturating round-to-nearest-even to E4M3 (cvt.rn.satfinite), scale_inv = 1 / scale correctly
// rounded; a group without a scale (0 or NaN) is scaled from its current amax, which every column block of
// it computes over the whole group (only where no history exists yet).

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#ifndef WARPS_ACROSS  // a block's 4 warps side by side in columns (1, 2 or 4), the rest of them stacked in rows
#define WARPS_ACROSS 1
#endif
#define WARP_COLS 64    // a warp's 8 lanes of 8 columns
#define BLOCK_COLS (WARP_COLS * WARPS_ACROSS)
#define CHUNK_ROWS 8    // a thread's rows
#define WARP_ROWS 32    // a warp's 4 chunks of rows
#define THREADS 128
#define PASS_ROWS (WARP_ROWS * THREADS / 32 / WARPS_ACROSS)  // rows a block covers per pass
#ifndef MIN_BLOCKS  // blocks per multiprocessor the registers are capped for (fp8_cast_cuda.MIN_BLOCKS)
#define MIN_BLOCKS 4
#endif

__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
  u16 packed;
  // the first source operand goes to the upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// E4M3's scale from an amax, as `fp8_quant_triton._scale_for_format(amax, 448)`: reciprocal then product
// (two roundings, as torch's FMT_MAX / amax), the largest finite float for an infinite quotient, 1 for an
// amax of 0 or inf.
__device__ __forceinline__ float scale_from_amax(float amax) {
  float scale = __fmul_rn(__frcp_rn(amax), 448.0f);
  if (isinf(scale)) scale = 3.4028234663852886e38f;
  return (amax == 0.0f || isinf(amax)) ? 1.0f : scale;
}

// Row r of the operand as 8 bf16 at column `col` (16 bytes), zeros for a row left out; with GATHER, token
// `token` of x (zeros for the padding token T).
__device__ __forceinline__ uint4 load_row(const u16* __restrict__ x, i64 r, int token, int col, int C, int T,
                                          bool wanted) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
#if GATHER
  if (wanted && token < T) v = __ldg(reinterpret_cast<const uint4*>(x + (i64)token * C + col));
#else
  if (wanted) v = __ldg(reinterpret_cast<const uint4*>(x + r * C + col));
#endif
  return v;
}

// The token index of row r, T (padding: zeros) for a row outside [start, end).
__device__ __forceinline__ int row_token(const i64* __restrict__ src, i64 r, i64 start, i64 end, int T) {
#if GATHER
  return (r >= start && r < end) ? (int)__ldg(src + r) : T;
#else
  return T;
#endif
}

// Max of |x| over rows [start, end), every column: a group without a scale.
__device__ float whole_group_amax(const u16* __restrict__ x, const i64* __restrict__ src, i64 start, i64 end,
                                  int C, int T, float* shared) {
  float amax = 0.0f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (i64 r = start + warp; r < end; r += THREADS / 32) {
    for (int col = lane * 8; col < C; col += 256) {
      uint4 v = load_row(x, r, row_token(src, r, start, end, T), col, C, T, true);
      u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) amax = fmaxf(amax, fmaxf(fabsf(bf16_lo(w[k])), fabsf(bf16_hi(w[k]))));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) shared[warp] = amax;
  __syncthreads();
  amax = shared[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) amax = fmaxf(amax, shared[w]);
  return amax;
}

// One thread's chunk: rows r0..r0+7 (those in [start, end) unless WHOLE) x columns col..col+7, cast into
// the row copy and the transposed copy; folds |x| into amax. ``tokens``: the rows' token indices (GATHER).
// WHOLE: every row is the group's and the transposed copy's 8-row runs lie on the 8-byte grid (no checks,
// vector stores).
template <bool WHOLE>
__device__ __forceinline__ void cast_chunk(const u16* __restrict__ x, const int (&tokens)[CHUNK_ROWS], i64 r0,
                                           i64 start, i64 end, int col, bool col_ok, int C, int T, float scale,
                                           unsigned char* __restrict__ q_row, unsigned char* __restrict__ q_col_at,
                                           i64 stride_qc, bool write_col, float& amax) {
  uint4 raw[CHUNK_ROWS];
#pragma unroll
  for (int i = 0; i < CHUNK_ROWS; ++i)
    raw[i] = load_row(x, r0 + i, tokens[i], col, C, T, WHOLE || (col_ok && r0 + i >= start && r0 + i < end));
  u32 q[CHUNK_ROWS][2];  // row i's 8 float8 bytes, columns 0-3 and 4-7
#pragma unroll
  for (int i = 0; i < CHUNK_ROWS; ++i) {
    const u32 w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
    float f[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = bf16_lo(w[k]);
      f[2 * k + 1] = bf16_hi(w[k]);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      amax = fmaxf(amax, fabsf(f[k]));  // fmaxf ignores a NaN operand, as the amax must
      f[k] = __fmul_rn(f[k], scale);
    }
    q[i][0] = e4m3x2(f[0], f[1]) | (e4m3x2(f[2], f[3]) << 16);
    q[i][1] = e4m3x2(f[4], f[5]) | (e4m3x2(f[6], f[7]) << 16);
#if WRITE_ROW
    if (WHOLE || (col_ok && r0 + i >= start && r0 + i < end))
      *reinterpret_cast<uint2*>(q_row + (r0 + i) * C + col) = make_uint2(q[i][0], q[i][1]);
#endif
  }
  if (!write_col || !(WHOLE || col_ok)) return;
  // 4 x 4 byte blocks transposed: rows 4j..4j+3 x columns 4h..4h+3 -> t[4h + k][j]
  u32 t[8][2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 a = q[4 * j][h], b = q[4 * j + 1][h], c = q[4 * j + 2][h], d = q[4 * j + 3][h];
      const u32 ab01 = __byte_perm(a, b, 0x5140), ab23 = __byte_perm(a, b, 0x7362);
      const u32 cd01 = __byte_perm(c, d, 0x5140), cd23 = __byte_perm(c, d, 0x7362);
      t[4 * h + 0][j] = __byte_perm(ab01, cd01, 0x5410);
      t[4 * h + 1][j] = __byte_perm(ab01, cd01, 0x7632);
      t[4 * h + 2][j] = __byte_perm(ab23, cd23, 0x5410);
      t[4 * h + 3][j] = __byte_perm(ab23, cd23, 0x7632);
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    unsigned char* dst = q_col_at + (i64)(col + k) * stride_qc + r0;
    if (WHOLE) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(t[k][0], t[k][1]);
    } else {
#pragma unroll
      for (int i = 0; i < CHUNK_ROWS; ++i)
        if (r0 + i >= start && r0 + i < end) dst[i] = (unsigned char)(t[k][i / 4] >> (8 * (i % 4)));
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
fp8_delayed_cast(const u16* __restrict__ x, const i64* __restrict__ src, const int* __restrict__ offsets,
                 const float* __restrict__ scale_g, unsigned char* __restrict__ q_row, float* __restrict__ s_row,
                 unsigned char* __restrict__ q_col, float* __restrict__ s_col, float* __restrict__ record,
                 const int* __restrict__ aligned_ends, i64 R, int C, int G, int T, i64 stride_qc, i64 stride_qg) {
  __shared__ float shared[THREADS / 32];
  const int g = blockIdx.y;
  const bool in_group = g < G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col = blockIdx.x * BLOCK_COLS + (warp % WARPS_ACROSS) * WARP_COLS + (lane & 7) * 8;
  const bool col_ok = col < C;  // C is a multiple of 8: a thread's 8 columns are all in or all out
  const i64 start = g > 0 ? (i64)offsets[g - 1] : 0;
  const i64 end = in_group ? (i64)offsets[g] : R;
  float scale = in_group ? scale_g[g] : 1.0f;
  if (!(scale > 0.0f)) scale = scale_from_amax(whole_group_amax(x, src, start, end, C, T, shared));  // block-uniform
  const float scale_inv = __frcp_rn(scale);
  i64 out_base = (i64)g * stride_qg;
#if ALIGN
  if (in_group && g > 0) out_base += ((i64)aligned_ends[g - 1] - start) / 16 * 16;
#endif
  unsigned char* q_col_at = q_col + out_base;
  // the transposed copy's 8-row runs on the 8-byte grid (always so for the FP8 path's layouts)
  const bool col_runs_aligned = (reinterpret_cast<size_t>(q_col_at) & 7) == 0 && (stride_qc & 7) == 0;
  const bool write_col = in_group;  // the tail group (rows past the last end) has a row copy only
  float amax = 0.0f;
  // passes over the rows from `start` rounded down to the 8-row grid; a warp takes 32 rows a pass, its lane
  // l's chunk rows r0 = base + 8 * (l / 8) onwards (warp-uniform loop: the shuffles need every lane)
  const i64 first = (start & ~(i64)(CHUNK_ROWS - 1)) + (warp / WARPS_ACROSS) * WARP_ROWS;
  int token_ahead = row_token(src, first + lane, start, end, T);  // row base + lane's token, a pass ahead
  for (i64 base = first; base < end; base += PASS_ROWS) {
    int tokens[CHUNK_ROWS];
#pragma unroll
    for (int i = 0; i < CHUNK_ROWS; ++i) tokens[i] = GATHER ? __shfl_sync(0xffffffffu, token_ahead, (lane & ~7) + i) : T;
    token_ahead = row_token(src, base + PASS_ROWS + lane, start, end, T);
    const i64 r0 = base + (lane >> 3) * CHUNK_ROWS;
    if (col_ok && r0 >= start && r0 + CHUNK_ROWS <= end && (col_runs_aligned || !write_col))
      cast_chunk<true>(x, tokens, r0, start, end, col, col_ok, C, T, scale, q_row, q_col_at, stride_qc, write_col,
                       amax);
    else
      cast_chunk<false>(x, tokens, r0, start, end, col, col_ok, C, T, scale, q_row, q_col_at, stride_qc, write_col,
                        amax);
  }
#if RECORD
  if (in_group) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    // a non-negative float orders as its bits: the amax is max-folded as an integer
    if (lane == 0) atomicMax(reinterpret_cast<int*>(record + g), __float_as_int(amax));
  }
#endif
#if WRITE_ROW
  if (blockIdx.x == 0)  // one column block writes the group's row scales
    for (i64 r = start + threadIdx.x; r < end; r += THREADS) s_row[r] = scale_inv;
#endif
  if (in_group) {
    for (int c = blockIdx.x * BLOCK_COLS + threadIdx.x; c < min(C, (blockIdx.x + 1) * BLOCK_COLS); c += THREADS)
      s_col[(i64)g * C + c] = scale_inv;
#if ALIGN
    // Zeros after the group's last row up to its aligned end (the weight-gradient GEMM's contraction reads
    // them): 16 rows of a column per store where the gap lies on the 16-byte grid (groups of whole 16-row
    // runs, as the FP8 path pads them), a byte at a time otherwise. A warp takes 4 columns' gaps.
    const i64 aligned_end = start + (end - start + ALIGN - 1) / ALIGN * ALIGN;
    const int runs = (int)((aligned_end - end + 15) / 16);
    for (int item = threadIdx.x; item < BLOCK_COLS * (ALIGN / 16); item += THREADS) {
      const int run = item % (ALIGN / 16), gap_col = blockIdx.x * BLOCK_COLS + item / (ALIGN / 16);
      if (run >= runs || gap_col >= C) continue;
      unsigned char* dst = q_col + out_base + (i64)gap_col * stride_qc + end + 16 * run;
      if (end + 16 * (run + 1) <= aligned_end && (reinterpret_cast<size_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      } else {
        for (int i = 0; i < 16 && end + 16 * run + i < aligned_end; ++i) dst[i] = 0;
      }
    }
#endif
  }
}
