// Hopper warpgroup MMA (wgmma, sm_90a) building blocks: shared-memory matrix
// descriptors, the fences and group waits that order the asynchronous MMAs,
// and D (64 x N, fp32) += A (64 x 16) * B (16 x N), 128-byte swizzled
// operands in shared memory (K-major; B also N-major), A also from registers.
//
// The operand layout is the one the mma.sync kernels already use: rows of
// 128 bytes (64 16-bit elements along K), the 16-byte chunk c of row r stored
// at chunk c ^ (r % 8). That is the hardware's 128-byte swizzle when the
// 8-row atoms (1024 bytes) start on 1024-byte boundaries, so one loader
// feeds both kinds of MMA.
//
// The accumulator of a warpgroup's m64nN: warp w (of 4) holds rows
// 16 w + lane / 4 and + 8; register 4 j + e of it is n8 tile j with the
// mma.m16n8k16 C layout (e = 0, 1: the upper row, columns 2 (lane % 4) and
// + 1; e = 2, 3: the lower row) -- so a warp's share is exactly a row of
// n8 accumulator tiles of mma.sync.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace turbomq {
namespace cuda {

// Descriptor of a K-major, 128-byte-swizzled operand at shared address
// `addr` (its 8-row atoms 1024-byte aligned): start address >> 4, leading
// byte offset unused (1), stride byte offset 1024 >> 4 between 8-row atoms,
// swizzle mode 1 (128 bytes). The k16 step ks of a 64-wide row starts
// 32 ks bytes further: descriptor + 2 ks.
__device__ __forceinline__ std::uint64_t wgmma_desc(std::uint32_t addr) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) |
         (static_cast<std::uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// Descriptor of an N-major (MN-major), 128-byte-swizzled operand: rows of
// 128 bytes are k indices, each holding 64 consecutive n; 8-row atoms 1024
// bytes apart (stride byte offset), and the next 64 n `panel_bytes` further
// (leading byte offset). A k16 step is two atoms: descriptor + 2048 >> 4.
__device__ __forceinline__ std::uint64_t wgmma_desc_mn(std::uint32_t addr,
                                                       std::uint32_t panel_bytes) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<std::uint64_t>((panel_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<std::uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// wgmma exists on sm_90a only. `nvcc -arch=sm_90a` (make cuda-check) also
// embeds compute_90 PTX, where these instructions do not assemble: there
// each is a trap. The extension itself is built for sm_90a (CMake), whose
// code runs on sm_90 GPUs only.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TURBOMQ_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define TURBOMQ_WGMMA_ASM(...) __trap()
#endif

// Orders the registers' earlier accesses (zeroing, reads) before the MMAs.
__device__ __forceinline__ void wgmma_fence() {
  TURBOMQ_WGMMA_ASM("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  TURBOMQ_WGMMA_ASM("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  TURBOMQ_WGMMA_ASM("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (cp.async, st.shared)
// made visible to the async proxy the MMAs read through.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The accumulator operands of an m64nN MMA (N / 2 fp32 registers per
// thread): the placeholders TURBOMQ_WGMMA_D<R> (%0 .. %R-1) and the in/out
// constraints TURBOMQ_WGMMA_OUT<R>(d), for R = N / 2 = 16, 32, .. 128.
#define TURBOMQ_WGMMA_D16 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define TURBOMQ_WGMMA_D32 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
  "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define TURBOMQ_WGMMA_D48 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
  "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
  "%42,%43,%44,%45,%46,%47}"
#define TURBOMQ_WGMMA_D64 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
  "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
  "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
  "%62,%63}"
#define TURBOMQ_WGMMA_D80 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
  "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
  "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
  "%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79}"
#define TURBOMQ_WGMMA_D96 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
  "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
  "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
  "%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81," \
  "%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}"
#define TURBOMQ_WGMMA_D112 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
  "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
  "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
  "%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81," \
  "%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100," \
  "%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111}"
#define TURBOMQ_WGMMA_D128 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
  "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
  "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
  "%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81," \
  "%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100," \
  "%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116," \
  "%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define TURBOMQ_WGMMA_OUT16(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
  "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define TURBOMQ_WGMMA_OUT32(d) \
  TURBOMQ_WGMMA_OUT16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
  "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), \
  "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define TURBOMQ_WGMMA_OUT48(d) \
  TURBOMQ_WGMMA_OUT32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
  "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define TURBOMQ_WGMMA_OUT64(d) \
  TURBOMQ_WGMMA_OUT48(d), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
  "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), \
  "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define TURBOMQ_WGMMA_OUT80(d) \
  TURBOMQ_WGMMA_OUT64(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), \
  "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), \
  "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define TURBOMQ_WGMMA_OUT96(d) \
  TURBOMQ_WGMMA_OUT80(d), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
  "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), \
  "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define TURBOMQ_WGMMA_OUT112(d) \
  TURBOMQ_WGMMA_OUT96(d), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), \
  "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), \
  "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), \
  "+f"(d[110]), "+f"(d[111])
#define TURBOMQ_WGMMA_OUT128(d) \
  TURBOMQ_WGMMA_OUT112(d), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), \
  "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), \
  "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
// The instruction: D += A * B with scale-d 1, no negation; SS: A and B by
// descriptor, both K-major; RS: A in four registers, B N-major (TB 1) or
// K-major (TB 0).
#define TURBOMQ_WGMMA_SS(N, TY, D, A, B) \
  "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " D ", " A ", " B ", 1, 1, 1, 0, 0;"
#define TURBOMQ_WGMMA_RS(N, TY, D, A, B, TB) \
  "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " D ", " A ", " B ", 1, 1, 1, " #TB ";"

// d (N / 2 floats per thread) += A * B; a, b descriptors. N: 32 to 256 in
// steps of 32.
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16(float* d, std::uint64_t a, std::uint64_t b) {
  static_assert(N % 32 == 0 && N >= 32 && N <= 256, "m64n32 .. m64n256, steps of 32");
#define TURBOMQ_WGMMA_SS_CASE(NN, DD, OUT, A0, B0)                                   \
  if constexpr (N == NN && std::is_same_v<T, __half>) {                               \
    TURBOMQ_WGMMA_ASM(TURBOMQ_WGMMA_SS(NN, "f16", DD, A0, B0) : OUT(d) : "l"(a), "l"(b)); \
  } else if constexpr (N == NN) {                                                     \
    TURBOMQ_WGMMA_ASM(TURBOMQ_WGMMA_SS(NN, "bf16", DD, A0, B0) : OUT(d) : "l"(a), "l"(b)); \
  }
  TURBOMQ_WGMMA_SS_CASE(32, TURBOMQ_WGMMA_D16, TURBOMQ_WGMMA_OUT16, "%16", "%17")
  TURBOMQ_WGMMA_SS_CASE(64, TURBOMQ_WGMMA_D32, TURBOMQ_WGMMA_OUT32, "%32", "%33")
  TURBOMQ_WGMMA_SS_CASE(96, TURBOMQ_WGMMA_D48, TURBOMQ_WGMMA_OUT48, "%48", "%49")
  TURBOMQ_WGMMA_SS_CASE(128, TURBOMQ_WGMMA_D64, TURBOMQ_WGMMA_OUT64, "%64", "%65")
  TURBOMQ_WGMMA_SS_CASE(160, TURBOMQ_WGMMA_D80, TURBOMQ_WGMMA_OUT80, "%80", "%81")
  TURBOMQ_WGMMA_SS_CASE(192, TURBOMQ_WGMMA_D96, TURBOMQ_WGMMA_OUT96, "%96", "%97")
  TURBOMQ_WGMMA_SS_CASE(224, TURBOMQ_WGMMA_D112, TURBOMQ_WGMMA_OUT112, "%112", "%113")
  TURBOMQ_WGMMA_SS_CASE(256, TURBOMQ_WGMMA_D128, TURBOMQ_WGMMA_OUT128, "%128", "%129")
#undef TURBOMQ_WGMMA_SS_CASE
}

// d += A * B with A (64 x 16) in registers -- four 32-bit registers per
// thread in mma.m16n8k16's A layout, warp w holding rows 16 w.. -- and B in
// shared memory: N-major (its rows are k, N contiguous; wgmma_desc_mn) or,
// with kMajorB, K-major (wgmma_desc).
template <typename T, int N, bool kMajorB = false>
__device__ __forceinline__ void wgmma_m64k16_rs(float* d, const std::uint32_t* a,
                                                std::uint64_t b) {
  static_assert(N == 64 || N == 128, "m64n64 or m64n128");
  constexpr bool f16 = std::is_same_v<T, __half>;
#define TURBOMQ_WGMMA_RS_CASE(NN, TY, DD, OUT, A0, B0, TB)                               \
  TURBOMQ_WGMMA_ASM(TURBOMQ_WGMMA_RS(NN, TY, DD, A0, B0, TB)                             \
                    : OUT(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
#define TURBOMQ_WGMMA_RS_N(NN, DD, OUT, A0, B0)                                           \
  if constexpr (f16 && kMajorB) {                                                        \
    TURBOMQ_WGMMA_RS_CASE(NN, "f16", DD, OUT, A0, B0, 0);                                \
  } else if constexpr (f16) {                                                            \
    TURBOMQ_WGMMA_RS_CASE(NN, "f16", DD, OUT, A0, B0, 1);                                \
  } else if constexpr (kMajorB) {                                                        \
    TURBOMQ_WGMMA_RS_CASE(NN, "bf16", DD, OUT, A0, B0, 0);                               \
  } else {                                                                               \
    TURBOMQ_WGMMA_RS_CASE(NN, "bf16", DD, OUT, A0, B0, 1);                               \
  }
  if constexpr (N == 64) {
    TURBOMQ_WGMMA_RS_N(64, TURBOMQ_WGMMA_D32, TURBOMQ_WGMMA_OUT32, "{%32,%33,%34,%35}", "%36")
  } else {
    TURBOMQ_WGMMA_RS_N(128, TURBOMQ_WGMMA_D64, TURBOMQ_WGMMA_OUT64, "{%64,%65,%66,%67}", "%68")
  }
#undef TURBOMQ_WGMMA_RS_N
#undef TURBOMQ_WGMMA_RS_CASE
}

}  // namespace cuda
}  // namespace turbomq
