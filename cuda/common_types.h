// What the TensorFlow kernels (cc/) and the CUDA launchers (cuda/) both name: the
// combiner and row-optimizer choices, a bag op's attributes, the type T accumulates in,
// the device reports of the GPU ops and the TT cache's set hash. Plain C++, no
// TensorFlow or CUDA headers, so that cc/ code built without CUDA includes it too.
// cc/ sees these in tensorflow::tf_ttemb (the using-declarations at the end), cuda/ from
// tf_ttemb::gpu.

#ifndef TF_TTEMB_CUDA_COMMON_TYPES_H_
#define TF_TTEMB_CUDA_COMMON_TYPES_H_

#include <cstdint>

#if defined(__CUDACC__)
#define TTEMB_HOST_DEVICE __host__ __device__
#else
#define TTEMB_HOST_DEVICE
#endif

namespace tf_ttemb {

// How a bag's rows combine. The ctypes harness passes the values as ints.
enum class Combiner : int { kSum = 0, kMean = 1, kSqrtn = 2, kMax = 3 };

// The optimizer GatherReduceSumSparseApply applies to each distinct row.
enum class RowOptimizer : int { kSgd = 0, kRowwiseAdagrad = 1, kAdagrad = 2 };

// The attributes every bag op takes: parsed once from the op's attrs in the kernel
// constructor (cc/, where they are BagAttrs) and passed to the launchers as part of
// their BagProblem (cuda/). Entries whose id is the padding id are skipped.
struct BagOptions {
  Combiner combiner = Combiner::kSum;
  bool has_weights = false;
  bool has_padding_id = false;
  int64_t padding_id = -1;
};

// The type every kernel sums T in: float for the half types and float, double
// for double (half types accumulate in float32).
template <typename T>
struct AccumulatorOf {
  using type = float;
};
template <>
struct AccumulatorOf<double> {
  using type = double;
};
template <typename T>
using AccT = typename AccumulatorOf<T>::type;

// The gradient w.r.t. the weight w of one entry e of a bag b of scale `scale`
// (1 for sum, 1 / sum_j w_j for mean, 1 / sqrt(sum_j w_j^2) for sqrtn), with
// dot = <dy_b, e> and dy_dot_out = <dy_b, out_b>:
//   sum:   dot
//   mean:  (dot - dy_dot_out) * scale
//   sqrtn: dot * scale - w * dy_dot_out * scale^2
// The CPU and GPU backward ops both use it; they leave 0 for padding entries
// and for bags of scale 0.
template <typename A>
inline TTEMB_HOST_DEVICE A WeightGradFromDot(Combiner combiner, A dot, A dy_dot_out, A scale, A w) {
  switch (combiner) {
    case Combiner::kMean:
      return (dot - dy_dot_out) * scale;
    case Combiner::kSqrtn:
      return dot * scale - w * dy_dot_out * scale * scale;
    default:
      return dot;
  }
}

// What a GPU bag op found wrong in its ids and row_splits, written on the device by the
// launchers (cuda/) and turned into the CPU kernel's InvalidArgument on the host (cc/),
// either by the op itself or, for the forward, by TfTtemb>CheckBagReport, which reads it
// from the forward's `report` output. The last three words describe the call, so that
// the report alone is enough to word the error. Plain int64 words: the CPU check kernel
// reads a copy of it as a tensor.
struct DeviceReport {
  int64_t first_bad_index;  // smallest j with ids[j] outside [0, N) and not padding
  int64_t bad_index_value;  // ids[first_bad_index]
  int64_t first_bad_split;  // smallest b with splits[b + 1] < splits[b]
  int64_t bad_split_value;  // splits[first_bad_split + 1]
  int64_t bad_split_prev;   // splits[first_bad_split]
  int64_t first_split;      // splits[0]
  int64_t last_split;       // splits[B]
  int64_t num_unique;       // params grad: distinct non-padding ids (U)
  int64_t num_rows;         // N
  int64_t nnz;              // number of ids
  int64_t num_bags;         // B
};
constexpr int64_t kDeviceReportWords = sizeof(DeviceReport) / sizeof(int64_t);
static_assert(sizeof(DeviceReport) % sizeof(int64_t) == 0,
              "DeviceReport must be a whole number of int64 words");

// What a GPU GroupBags found wrong in its row_splits and ids (cc/ops/grouped_bags_ops.cc),
// written on the device and worded on the host by TfTtemb>CheckGroupReport with the
// CPU kernel's message. Entry positions are those of the op's `indices` input (every
// feature's ids, one feature after the other); `bad_feature` and `bad_position` place
// the first bad id in its own feature's ids. The last words describe the call.
struct GroupReport {
  int64_t first_bad_entry;  // smallest j with indices[j] outside its table, not padding
  int64_t bad_value;        // indices[first_bad_entry]
  int64_t bad_feature;      // the feature of first_bad_entry
  int64_t bad_position;     // first_bad_entry - (the feature's first entry)
  int64_t first_bad_split;  // smallest k with row_splits[k + 1] < row_splits[k]
  int64_t bad_split_value;  // row_splits[first_bad_split + 1]
  int64_t bad_split_prev;   // row_splits[first_bad_split]
  int64_t first_split;      // row_splits[0]
  int64_t last_split;       // row_splits[num_features * batch]
  int64_t nnz;              // entries
  int64_t num_bags;         // num_features * batch
};
constexpr int64_t kGroupReportWords = sizeof(GroupReport) / sizeof(int64_t);
static_assert(sizeof(GroupReport) % sizeof(int64_t) == 0,
              "GroupReport must be a whole number of int64 words");

// Most cores of a TT table the GPU kernels take (the host checks it before a launch).
constexpr int kMaxTTCores = 8;

// What a GPU TT op found and counted (TTUniqueIds, TTRows, TTRowsGrad), written on the
// device by the launchers of cuda/tt_embedding_kernels.cuh and worded on the host (cc/)
// with the CPU kernels' messages: by the op itself, or for TTRows, by
// TfTtemb>CheckTTRowsReport from its `report` output. Fields are -1 when unset, except
// the counts, which the launchers named beside them set.
struct TTReport {
  int64_t first_bad_index;         // UniqueIds: smallest j with ids[j] outside
                                   //   [0, num_embeddings) and not the padding id
                                   //   -> "indices[j] = v is not in [0, num_embeddings)"
                                   //      (+ " and is not padding_id (P)");
                                   // Rows / RowsGrad*: smallest j < num_ids with
                                   //   ids[j] outside [0, num_tables * prod(p))
                                   //   -> "ids[j] = v is not in [0, M)"
  int64_t bad_index_value;         // ids[first_bad_index]
  int64_t num_unique;              // UniqueIds: U (distinct non-padding global ids)
  int64_t num_ids;                 // Rows / RowsGradPrepare: the ids counted (max_ids
                                   //   or *num_ids)
  int64_t core_rows[kMaxTTCores];  // RowsGradPrepare: n_k, distinct core rows
                                   //   of core k touched (0 for k >= T)
  int64_t work_items;              // RowsGradPrepare: what Compute's work buffers
  int64_t work_values;             //   need for these ids (RowsGradWorkBytes)
  int64_t reserved[2];
};
constexpr int64_t kTTReportWords = sizeof(TTReport) / sizeof(int64_t);
static_assert(sizeof(TTReport) == 16 * sizeof(int64_t), "TTReport is 16 words");

// Entries held by several parts read end to end (GroupBags' `indices` list): part p
// holds entries [starts[p], starts[p + 1]) at parts[p][0 ...], starts[0] = 0. A cursor
// reads entries in increasing order from `first`, locating its part once (a binary
// search) and then stepping over part ends; the CPU kernel and the CUDA one read alike.
template <typename Tindex>
struct PartsCursor {
  const Tindex* const* parts;
  const int64_t* starts;
  int64_t part;

  // `first` < starts[num_parts]; num_parts >= 1.
  TTEMB_HOST_DEVICE PartsCursor(const Tindex* const* parts_in, const int64_t* starts_in,
                                int64_t num_parts, int64_t first)
      : parts(parts_in), starts(starts_in), part(0) {
    int64_t hi = num_parts - 1;  // the last p with starts[p] <= first (skips empty parts)
    while (part < hi) {
      const int64_t mid = (part + hi + 1) / 2;
      if (starts[mid] <= first) {
        part = mid;
      } else {
        hi = mid - 1;
      }
    }
  }

  // Entry j: at least every entry read before, less than starts[num_parts].
  TTEMB_HOST_DEVICE Tindex operator[](int64_t j) {
    while (j >= starts[part + 1]) ++part;
    return parts[part][j - starts[part]];
  }
};

// Fixed 64-bit mixer (splitmix64's finaliser): which set of TTCacheCount's frequency
// table an id belongs to, on the CPU and the GPU alike.
inline TTEMB_HOST_DEVICE uint64_t MixId(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace tf_ttemb

// The names above that cc/ uses, seen in tensorflow::tf_ttemb. (cuda/'s namespace
// tf_ttemb::gpu is nested in tf_ttemb: it sees them as they are.)
namespace tensorflow {
namespace tf_ttemb {
using ::tf_ttemb::AccT;
using ::tf_ttemb::Combiner;
using ::tf_ttemb::DeviceReport;
using ::tf_ttemb::GroupReport;
using ::tf_ttemb::kDeviceReportWords;
using ::tf_ttemb::kGroupReportWords;
using ::tf_ttemb::kMaxTTCores;
using ::tf_ttemb::kTTReportWords;
using ::tf_ttemb::MixId;
using ::tf_ttemb::PartsCursor;
using ::tf_ttemb::RowOptimizer;
using ::tf_ttemb::TTReport;
using ::tf_ttemb::WeightGradFromDot;
}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CUDA_COMMON_TYPES_H_
