// The grouped_bags family's attrs, validation and messages (shared with the GPU
// glue, grouped_bags_kernels_gpu.cc), and its CPU kernels: GroupBags, which
// checks each id against its own feature's table and reorders the bags example
// by example, and CheckGroupReport, which words a GPU GroupBags' report.

#include "cc/kernels/grouped_bags_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>

#include "cc/kernels/check_report_op.h"
#include "cc/kernels/gather_reduce_sum_cpu.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/shape_util.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/lib/core/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {

Status GetGroupAttrs(OpKernelConstruction* ctx, bool with_weights, GroupAttrs* attrs) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_rows", &attrs->num_rows));
  TF_RETURN_IF_ERROR(ctx->GetAttr("row_offsets", &attrs->row_offsets));
  TF_RETURN_IF_ERROR(ctx->GetAttr("padding_ids", &attrs->padding_ids));
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_padding_ids", &attrs->has_padding_ids));
  TF_RETURN_IF_ERROR(ctx->GetAttr("labels", &attrs->labels));
  if (with_weights) TF_RETURN_IF_ERROR(ctx->GetAttr("has_weights", &attrs->has_weights));
  const size_t n = attrs->num_rows.size();
  const std::pair<const char*, size_t> lists[] = {
      {"row_offsets", attrs->row_offsets.size()},
      {"padding_ids", attrs->padding_ids.size()},
      {"has_padding_ids", attrs->has_padding_ids.size()},
      {"labels", attrs->labels.size()},
  };
  for (const auto& [name, size] : lists) {
    if (size != n) {
      return errors::InvalidArgument(name, " has ", size, " entries but num_rows has ", n,
                                     " (one per feature)");
    }
  }
  constexpr int64_t kMaxRow = std::numeric_limits<int64_t>::max() / 2;
  for (size_t t = 0; t < n; ++t) {
    const int64_t rows = attrs->num_rows[t], offset = attrs->row_offsets[t];
    if (rows < 0 || rows > kMaxRow) {
      return errors::InvalidArgument("num_rows[", t, "] = ", rows, " is not in [0, ", kMaxRow, "]");
    }
    if (offset < 0 || offset > kMaxRow - rows) {
      return errors::InvalidArgument("row_offsets[", t, "] = ", offset, " is not in [0, ",
                                     kMaxRow - rows, "]");
    }
  }
  return OkStatus();
}

Status ValidateGroupInputs(const GroupAttrs& attrs, GroupArgs* args) {
  TF_RETURN_IF_ERROR(CheckSplitsShape(
      *args->row_splits, 1, "row_splits must be a vector [B + 1] with at least 1 element"));
  TF_RETURN_IF_ERROR(CheckRank(*args->weights, 1, "weights must be a vector"));
  args->part_starts.assign(1, 0);
  for (const Tensor* part : args->indices) {
    args->part_starts.push_back(args->part_starts.back() + part->NumElements());
  }
  args->nnz = args->part_starts.back();
  if (attrs.has_weights && args->weights->NumElements() != args->nnz) {
    return errors::InvalidArgument("weights has ", args->weights->NumElements(),
                                   " entries but indices has ", args->nnz);
  }
  const int64_t num_features = attrs.num_features();
  const int64_t num_bags = args->row_splits->NumElements() - 1;
  if (num_bags % num_features != 0) {
    return errors::InvalidArgument("row_splits has ", num_bags + 1,
                                   " entries, not one more than a multiple of the ", num_features,
                                   " features");
  }
  args->batch = num_bags / num_features;
  return OkStatus();
}

Status GroupBadIndexError(const GroupAttrs& attrs, int64_t feature, int64_t position,
                          int64_t value) {
  BagAttrs bag;
  bag.has_padding_id = attrs.has_padding_ids[feature];
  bag.padding_id = attrs.padding_ids[feature];
  const Status bad = BadIndexError(position, value, attrs.num_rows[feature], bag);
  return errors::InvalidArgument("feature ", attrs.labels[feature], ": ", bad.message());
}

Status GroupReportStatus(const GroupReport& r, const GroupAttrs& attrs) {
  TF_RETURN_IF_ERROR(RowSplitsReportStatus(r));
  if (r.first_bad_entry >= 0) {
    if (r.bad_feature < 0 || r.bad_feature >= attrs.num_features()) {
      return errors::InvalidArgument("report names feature ", r.bad_feature, " of ",
                                     attrs.num_features());
    }
    return GroupBadIndexError(attrs, r.bad_feature, r.bad_position, r.bad_value);
  }
  return OkStatus();
}

Status ValidateGroupReportInput(const Tensor& report, bool* empty) {
  *empty = report.NumElements() == 0;
  if (*empty || (report.dims() == 1 && report.NumElements() == kGroupReportWords)) {
    return OkStatus();
  }
  return errors::InvalidArgument("report must be empty or hold ", kGroupReportWords,
                                 " words, got shape ", report.shape().DebugString());
}

// The CPU GroupBags: checks the row_splits, then, over the thread pool, each
// bag of the output order (b * T + t) copies bag t * B + b, checking each id
// against feature t's table; the first bad entry (smallest j) is raised.
template <typename T, typename Tindex>
struct GroupBagsLaunch<CpuDevice, T, Tindex> {
  static constexpr int64_t kReportWords = 0;

  static Status Run(OpKernelContext* ctx, const GroupAttrs& attrs, const GroupArgs& a) {
    const int64_t num_features = attrs.num_features(), batch = a.batch, nnz = a.nnz;
    const int64_t num_bags = num_features * batch;
    const int64_t* splits = a.row_splits->flat<int64_t>().data();
    TF_RETURN_IF_ERROR(ValidateRowSplits(splits, num_bags, nnz));
    int64_t* group_splits = a.group_row_splits->flat<int64_t>().data();
    group_splits[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < num_features; ++t) {
        const int64_t k = b * num_features + t, source = t * batch + b;
        group_splits[k + 1] = group_splits[k] + splits[source + 1] - splits[source];
      }
    }
    std::vector<const Tindex*> parts;
    for (const Tensor* part : a.indices) parts.push_back(part->flat<Tindex>().data());
    const int64_t num_parts = static_cast<int64_t>(parts.size());
    const int64_t* starts = a.part_starts.data();
    int64_t* group_ids = a.group_indices->flat<int64_t>().data();
    const T* weights = attrs.has_weights ? a.weights->flat<T>().data() : nullptr;
    T* group_weights = attrs.has_weights ? a.group_weights->flat<T>().data() : nullptr;
    int64_t* positions = attrs.has_weights ? a.positions->flat<int64_t>().data() : nullptr;
    std::atomic<int64_t> first_bad{nnz};
    auto copy = [&](int64_t begin, int64_t end) {
      int64_t bad = nnz;
      for (int64_t k = begin; k < end; ++k) {
        const int64_t b = k / num_features, t = k % num_features;
        const int64_t from = splits[t * batch + b], to = group_splits[k];
        const int64_t length = splits[t * batch + b + 1] - from;
        if (length == 0) continue;
        const int64_t rows = attrs.num_rows[t], offset = attrs.row_offsets[t];
        PartsCursor<Tindex> ids(parts.data(), starts, num_parts, from);
        for (int64_t e = 0; e < length; ++e) {
          const int64_t id = static_cast<int64_t>(ids[from + e]);
          int64_t row = -1;
          if (!attrs.IsPadding(t, id)) {
            if (id >= 0 && id < rows) {
              row = offset + id;
            } else {
              bad = std::min(bad, from + e);
            }
          }
          group_ids[to + e] = row;
          if (weights != nullptr) {
            group_weights[to + e] = weights[from + e];
            positions[from + e] = to + e;
          }
        }
      }
      int64_t seen = first_bad.load();
      while (bad < seen && !first_bad.compare_exchange_weak(seen, bad)) {
      }
    };
    const int64_t cost = num_bags > 0 ? 8 * std::max<int64_t>(1, nnz / num_bags) : 1;
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(num_bags, cost, copy);
    const int64_t j = first_bad.load();
    if (j == nnz) return OkStatus();
    // The feature whose entries [splits[t * B], splits[(t + 1) * B]) hold j.
    int64_t t = 0;
    while (t + 1 < num_features && splits[(t + 1) * batch] <= j) ++t;
    PartsCursor<Tindex> ids(parts.data(), starts, num_parts, j);
    return GroupBadIndexError(attrs, t, j - splits[t * batch], static_cast<int64_t>(ids[j]));
  }
};

namespace {

// An empty report (a CPU GroupBags') is OK; a GPU one, copied here, raises what it holds.
REGISTER_KERNEL_BUILDER(Name("TfTtemb>CheckGroupReport").Device(DEVICE_CPU),
                        CheckReportCpuOp<GroupReportTraits>);

TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GroupBags", GroupBagsOp)

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow
