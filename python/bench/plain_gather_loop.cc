// A plain CPU embedding-bag forward on this machine: the simplest weighted
// random-row gather-sum that keeps rows prefetched ahead, with none of an op's
// work around it (no validation, no framework, no thread pool's wake-up:
// persistent threads released by a spin barrier, the caller working too).
// bench_plain_gather_loop.py builds it with -march=native and runs it at the
// sweep's shapes, to tell how a table's dtype changes the time of a gather on
// this machine apart from any kernel's choices. Not a lower bound: rows of
// more than 16 vectors (D > 256 with AVX-512, D > 128 with AVX2) are summed in
// memory with a plain prefetch, and the op's tuned prefetches beat it there.
//
// plain_gather_loop N D B L THREADS REPEATS DTYPE LINES AHEAD[,AHEAD...]
//   DTYPE float32 | float16 | bfloat16 (table and weights), LINES first | all
//   (prefetch each row's first line, or every line of it), AHEAD rows ahead.
// Prints one JSON object per AHEAD: median and min ms over REPEATS timed
// passes (after 3 untimed), and a checksum of the output.
//
// The data is exact in every dtype, so the checksum is one number: row r's
// column c is ((7r + 3c) mod 16 - 8) / 8, entry j's weight ((j mod 4) + 1) / 4,
// entry j's id splitmix64(j) mod N, bag b holds entries [bL, (b + 1)L), and the
// checksum is the sum of out[i] * (i mod 7 + 1) in double.

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

enum class Dtype { kFloat32, kFloat16, kBfloat16 };

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec LoadF(const float* p) { return _mm512_loadu_ps(p); }
inline void StoreF(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Load(const void* p, Dtype t) {
  if (t == Dtype::kFloat32) return _mm512_loadu_ps(p);
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  if (t == Dtype::kFloat16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float x) { return _mm256_set1_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec LoadF(const float* p) { return _mm256_loadu_ps(p); }
inline void StoreF(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Load(const void* p, Dtype t) {
  if (t == Dtype::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(p));
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  if (t == Dtype::kFloat16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The 16-bit patterns of a value exact in both half types.
uint16_t ToHalfBits(float x, Dtype t) {
  if (t == Dtype::kBfloat16) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return static_cast<uint16_t>(u >> 16);
  }
  return _cvtss_sh(x, 0);
}

float Weight(int64_t j) { return static_cast<float>(j % 4 + 1) * 0.25f; }

struct Problem {
  const char* table;
  const int64_t* ids;
  const float* weights;
  float* out;
  int64_t dim, bags, bag_len, row_bytes;
  Dtype dtype;
  bool all_lines;
  int64_t ahead;
};

inline void Prefetch(const Problem& p, int64_t entry) {
  if (entry >= p.bags * p.bag_len) return;
  const char* row = p.table + p.ids[entry] * p.row_bytes;
  if (!p.all_lines) {
    _mm_prefetch(row, _MM_HINT_T1);
    return;
  }
  for (int64_t o = 0; o < p.row_bytes; o += 64) _mm_prefetch(row + o, _MM_HINT_T1);
}

// Bags [b0, b1): the row's kVecs vectors summed in registers.
template <int kVecs>
void SumBags(const Problem& p, int64_t b0, int64_t b1) {
  const int64_t elem = p.row_bytes / p.dim;
  for (int64_t b = b0; b < b1; ++b) {
    Vec acc[kVecs];
    for (int v = 0; v < kVecs; ++v) acc[v] = Zero();
    for (int64_t j = b * p.bag_len; j < (b + 1) * p.bag_len; ++j) {
      Prefetch(p, j + p.ahead);
      const char* row = p.table + p.ids[j] * p.row_bytes;
      const Vec w = Set1(p.weights[j]);
      for (int v = 0; v < kVecs; ++v) acc[v] = Fma(w, Load(row + v * kLanes * elem, p.dtype), acc[v]);
    }
    for (int v = 0; v < kVecs; ++v) StoreF(p.out + b * p.dim + v * kLanes, acc[v]);
  }
}

// Rows of any other number of vectors (more than 16, or 3, 5, ...): the sums
// in the output row, which stays in L1.
void SumBagsWide(const Problem& p, int64_t b0, int64_t b1) {
  const int64_t elem = p.row_bytes / p.dim;
  for (int64_t b = b0; b < b1; ++b) {
    float* sums = p.out + b * p.dim;
    std::fill(sums, sums + p.dim, 0.0f);
    for (int64_t j = b * p.bag_len; j < (b + 1) * p.bag_len; ++j) {
      Prefetch(p, j + p.ahead);
      const char* row = p.table + p.ids[j] * p.row_bytes;
      const Vec w = Set1(p.weights[j]);
      for (int64_t c = 0; c < p.dim; c += kLanes) {
        StoreF(sums + c, Fma(w, Load(row + c * elem, p.dtype), LoadF(sums + c)));
      }
    }
  }
}

void SumBagsAnyWidth(const Problem& p, int64_t b0, int64_t b1) {
  switch (p.dim / kLanes) {
    case 1: return SumBags<1>(p, b0, b1);
    case 2: return SumBags<2>(p, b0, b1);
    case 4: return SumBags<4>(p, b0, b1);
    case 8: return SumBags<8>(p, b0, b1);
    case 16: return SumBags<16>(p, b0, b1);
    default: return SumBagsWide(p, b0, b1);
  }
}

// Runs passes over all bags on `threads` threads (the caller is thread 0),
// each thread taking an equal share of the bags; returns each pass's ms.
std::vector<double> TimePasses(const Problem& p, int threads, int passes) {
  std::atomic<int> generation{0}, done{0};
  std::atomic<bool> stop{false};
  auto share = [&](int t) {
    SumBagsAnyWidth(p, p.bags * t / threads, p.bags * (t + 1) / threads);
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) {
    helpers.emplace_back([&, t] {
      int seen = 0;
      while (true) {
        int g;
        while ((g = generation.load(std::memory_order_acquire)) == seen) {
          if (stop.load(std::memory_order_acquire)) return;
          _mm_pause();
        }
        seen = g;
        share(t);
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }
  std::vector<double> ms;
  for (int pass = 0; pass < passes; ++pass) {
    done.store(0, std::memory_order_release);
    const auto start = std::chrono::steady_clock::now();
    generation.fetch_add(1, std::memory_order_acq_rel);
    share(0);
    while (done.load(std::memory_order_acquire) < threads - 1) _mm_pause();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }
  stop.store(true, std::memory_order_release);
  for (auto& h : helpers) h.join();
  return ms;
}

int Usage(const char* why) {
  std::fprintf(stderr,
               "plain_gather_loop: %s\nusage: plain_gather_loop N D B L THREADS REPEATS "
               "float32|float16|bfloat16 first|all AHEAD[,AHEAD...]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) return Usage("expected 9 arguments");
  const int64_t rows = std::atoll(argv[1]), dim = std::atoll(argv[2]);
  const int64_t bags = std::atoll(argv[3]), bag_len = std::atoll(argv[4]);
  const int threads = std::atoi(argv[5]), repeats = std::atoi(argv[6]);
  const std::string dtype_name = argv[7], lines = argv[8];
  if (rows < 1 || bags < 1 || bag_len < 1 || threads < 1 || repeats < 1) {
    return Usage("N, B, L, THREADS and REPEATS must be positive");
  }
  if (dim < kLanes || dim % kLanes != 0) return Usage("D must be a positive multiple of the lanes");
  Dtype dtype;
  if (dtype_name == "float32") {
    dtype = Dtype::kFloat32;
  } else if (dtype_name == "float16") {
    dtype = Dtype::kFloat16;
  } else if (dtype_name == "bfloat16") {
    dtype = Dtype::kBfloat16;
  } else {
    return Usage("DTYPE must be float32, float16 or bfloat16");
  }
  if (lines != "first" && lines != "all") return Usage("LINES must be first or all");

  const int64_t elem = dtype == Dtype::kFloat32 ? 4 : 2;
  const int64_t table_bytes = rows * dim * elem;
  constexpr int64_t kHuge = int64_t{2} << 20;
  char* table = static_cast<char*>(std::aligned_alloc(kHuge, (table_bytes + kHuge - 1) / kHuge * kHuge));
  if (table == nullptr) return Usage("out of memory");
  madvise(table, table_bytes, MADV_HUGEPAGE);  // as the op's CollapseToHugePages does
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) {
      const float x = static_cast<float>((7 * r + 3 * c) % 16 - 8) * 0.125f;
      if (dtype == Dtype::kFloat32) {
        reinterpret_cast<float*>(table)[r * dim + c] = x;
      } else {
        reinterpret_cast<uint16_t*>(table)[r * dim + c] = ToHalfBits(x, dtype);
      }
    }
  }
  const int64_t nnz = bags * bag_len;
  std::vector<int64_t> ids(nnz);
  std::vector<float> weights(nnz);
  for (int64_t j = 0; j < nnz; ++j) {
    ids[j] = static_cast<int64_t>(SplitMix64(static_cast<uint64_t>(j)) % static_cast<uint64_t>(rows));
    weights[j] = Weight(j);
  }
  std::vector<float> out(bags * dim);

  const char* list = argv[9];
  while (*list != '\0') {
    char* next;
    const int64_t ahead = std::strtoll(list, &next, 10);
    if (next == list || ahead < 1) return Usage("AHEAD must be positive integers");
    const Problem p{table, ids.data(), weights.data(), out.data(), dim, bags, bag_len,
                    dim * elem, dtype, lines == "all", ahead};
    std::vector<double> ms = TimePasses(p, threads, repeats + 3);
    ms.erase(ms.begin(), ms.begin() + 3);
    std::sort(ms.begin(), ms.end());
    double checksum = 0.0;
    for (int64_t i = 0; i < bags * dim; ++i) checksum += static_cast<double>(out[i]) * (i % 7 + 1);
    std::printf(
        "{\"dtype\": \"%s\", \"lines\": \"%s\", \"ahead\": %lld, \"lanes\": %d, "
        "\"median_ms\": %.6f, \"min_ms\": %.6f, \"checksum\": %.6f}\n",
        dtype_name.c_str(), lines.c_str(), static_cast<long long>(ahead), kLanes,
        ms[ms.size() / 2], ms.front(), checksum);
    std::fflush(stdout);
    list = *next == ',' ? next + 1 : next;
  }
  std::free(table);
  return 0;
}
