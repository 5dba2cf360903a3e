// The validation of the TT embedding family, shared by the OpKernels of both
// devices (tt_embedding_op.h), the CPU kernels (tt_embedding_cpu.h,
// tt_embedding_{forward,backward}_cpu.cc) and the GPU glue (tt_embedding_kernels_gpu.cc): the
// factorisation's attrs, the inputs' shapes and values, the GPU kernels' own limits, and the error
// messages. See docs/tt_embedding_contract.md for the layout.

#include "cc/kernels/tt_embedding_kernels.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/shape_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace tf_ttemb {

// ---------------------------------------------------------------------------
// Attributes and validation (shared with the GPU glue).

namespace {

// a * b, or an error when it exceeds 2^62 (ids and sizes stay far from
// int64 overflow).
Status CheckedMul(int64_t a, int64_t b, const char* what, int64_t* out) {
  constexpr int64_t kLimit = int64_t{1} << 62;
  if (a != 0 && b > kLimit / a) {
    return errors::InvalidArgument(what, " is too large: ", a, " * ", b, " exceeds 2^62");
  }
  *out = a * b;
  return OkStatus();
}

}  // namespace

// Most elements of one id's partial product (1 GiB of float32).
constexpr int64_t kMaxPartialElements = int64_t{1} << 28;

Status GetTTShape(OpKernelConstruction* ctx, TTShape* shape) {
  std::vector<int64_t> p, q, ranks;
  int64_t num_cores;
  TF_RETURN_IF_ERROR(ctx->GetAttr("p_shapes", &p));
  TF_RETURN_IF_ERROR(ctx->GetAttr("q_shapes", &q));
  TF_RETURN_IF_ERROR(ctx->GetAttr("ranks", &ranks));
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_cores", &num_cores));
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_tables", &shape->num_tables));
  if (static_cast<int64_t>(p.size()) != num_cores || static_cast<int64_t>(q.size()) != num_cores ||
      static_cast<int64_t>(ranks.size()) != num_cores - 1) {
    return errors::InvalidArgument("p_shapes and q_shapes need num_cores = ", num_cores,
                                   " entries and ranks num_cores - 1, got ", p.size(), ", ",
                                   q.size(), " and ", ranks.size());
  }
  for (int k = 0; k < num_cores; ++k) {
    if (p[k] < 1) {
      return errors::InvalidArgument("p_shapes[", k, "] = ", p[k], " must be >= 1");
    }
    if (q[k] < 1) {
      return errors::InvalidArgument("q_shapes[", k, "] = ", q[k], " must be >= 1");
    }
  }
  for (int k = 0; k + 1 < num_cores; ++k) {
    if (ranks[k] < 1) {
      return errors::InvalidArgument("ranks[", k, "] = ", ranks[k], " must be >= 1");
    }
  }
  const int T = static_cast<int>(num_cores);
  shape->num_cores = T;
  shape->p = p;
  shape->q = q;
  shape->r.assign(T + 1, 1);
  for (int k = 1; k < T; ++k) shape->r[k] = ranks[k - 1];
  shape->stride.assign(T, 1);
  for (int k = T - 2; k >= 0; --k) {
    TF_RETURN_IF_ERROR(
        CheckedMul(shape->stride[k + 1], p[k + 1], "prod(p_shapes)", &shape->stride[k]));
  }
  TF_RETURN_IF_ERROR(CheckedMul(shape->stride[0], p[0], "prod(p_shapes)", &shape->rows_per_table));
  int64_t unused;
  TF_RETURN_IF_ERROR(
      CheckedMul(shape->rows_per_table, shape->num_tables, "num_tables * prod(p_shapes)", &unused));
  shape->width.resize(T);
  shape->cols.resize(T);
  int64_t cols = 1;
  for (int k = 0; k < T; ++k) {
    int64_t width;
    TF_RETURN_IF_ERROR(CheckedMul(shape->r[k], q[k], "a core's row width", &width));
    TF_RETURN_IF_ERROR(CheckedMul(width, shape->r[k + 1], "a core's row width", &width));
    shape->width[k] = width;
    TF_RETURN_IF_ERROR(CheckedMul(cols, q[k], "prod(q_shapes)", &cols));
    shape->cols[k] = cols;
    // The kernels hold at least one id's partial product of every level,
    // (q_0 * ... * q_k) x r_{k+1} elements: bound it before any kernel sizes
    // scratch from it (an allocation that large would fail in the kernel).
    int64_t partial;
    TF_RETURN_IF_ERROR(CheckedMul(cols, shape->r[k + 1], "a partial product's size", &partial));
    if (partial > kMaxPartialElements) {
      return errors::ResourceExhausted("the TT partial product of one id after core ", k,
                                       " has (q_shapes[0] * ... * q_shapes[", k, "]) * r_", k + 1,
                                       " = ", cols, " * ", shape->r[k + 1], " = ", partial,
                                       " elements, more than the ", kMaxPartialElements,
                                       " the kernels allow (check q_shapes and ranks)");
    }
  }
  shape->dim = cols;
  return OkStatus();
}

Status ValidateCore(const Tensor& core, int k, const TTShape& shape) {
  const int64_t rows = shape.num_tables * shape.p[k];
  if (core.dims() != 2 || core.dim_size(0) != rows || core.dim_size(1) != shape.width[k]) {
    return errors::InvalidArgument("cores[", k, "] must be [num_tables * p_shapes[", k, "], r_", k,
                                   " * q_", k, " * r_", k + 1, "] = [", rows, ", ", shape.width[k],
                                   "], got shape ", core.shape().DebugString());
  }
  return OkStatus();
}

Status ValidateGlobalIdsShape(const Tensor& ids) {
  return CheckRank(ids, 1, "ids must be a vector [U]");
}

Status GlobalIdError(int64_t position, int64_t value, int64_t limit) {
  return errors::InvalidArgument("ids[", position, "] = ", value, " is not in [0, ", limit, ")");
}

Status GlobalIdsReportStatus(const TTReport& report, int64_t limit) {
  if (report.first_bad_index >= 0) {
    return GlobalIdError(report.first_bad_index, report.bad_index_value, limit);
  }
  return OkStatus();
}

Status GetTTRowsReportAttrs(OpKernelConstruction* ctx, int64_t* limit) {
  return ctx->GetAttr("limit", limit);
}

Status ValidateTTReportInput(const Tensor& report, bool* empty) {
  *empty = report.NumElements() == 0;
  if (*empty || (report.dims() == 1 && report.NumElements() == kTTReportWords)) {
    return OkStatus();
  }
  return errors::InvalidArgument("report must be empty or hold ", kTTReportWords,
                                 " words, got shape ", report.shape().DebugString());
}

Status ValidateGlobalIdValues(const Tensor& ids, const TTShape& shape) {
  const auto flat = ids.flat<int64_t>();
  const int64_t limit = shape.num_ids();
  for (int64_t j = 0; j < flat.size(); ++j) {
    if (flat(j) < 0 || flat(j) >= limit) {
      return GlobalIdError(j, flat(j), limit);
    }
  }
  return OkStatus();
}

Status ValidateRowsInputs(OpKernelContext* ctx, const TTShape& shape, OpInputList* cores) {
  TF_RETURN_IF_ERROR(ctx->input_list("cores", cores));
  for (int k = 0; k < shape.num_cores; ++k) {
    TF_RETURN_IF_ERROR(ValidateCore((*cores)[k], k, shape));
  }
  return ValidateGlobalIdsShape(ctx->input(0));
}

Status ValidateRowsGradShape(const Tensor& grad, int64_t num_ids, const TTShape& shape) {
  if (grad.dims() != 2 || grad.dim_size(0) != num_ids || grad.dim_size(1) != shape.dim) {
    return errors::InvalidArgument("grad must be [", num_ids, ", ", shape.dim,
                                   "] like the rows, got shape ", grad.shape().DebugString());
  }
  return OkStatus();
}

Status GetRowsBagsGradAttrs(OpKernelConstruction* ctx, BagAttrs* attrs) {
  std::string combiner;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiner", &combiner));
  TF_RETURN_IF_ERROR(ParseCombiner(combiner, &attrs->combiner));
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_weights", &attrs->has_weights));
  attrs->has_padding_id = true;
  attrs->padding_id = -1;
  return OkStatus();
}

Status ValidateRowsBagsGradShapes(OpKernelContext* ctx, const TTShape& shape, const BagAttrs& attrs,
                                  int64_t* num_bags, int64_t* nnz) {
  const int first = 1 + shape.num_cores;
  const Tensor& grad = ctx->input(first);
  BagShapes bags;
  TF_RETURN_IF_ERROR(ValidateBagShapes(ctx->input(first + 1), ctx->input(first + 2),
                                       ctx->input(first + 3), attrs, &bags));
  if (grad.dims() != 2 || grad.dim_size(0) != bags.num_bags || grad.dim_size(1) != shape.dim) {
    return errors::InvalidArgument("grad must be [", bags.num_bags, ", ", shape.dim,
                                   "] like the bags' output, got shape ",
                                   grad.shape().DebugString());
  }
  *num_bags = bags.num_bags;
  *nnz = bags.nnz;
  return OkStatus();
}

namespace {

Status TableSplitsError(int64_t position, int64_t value, const char* rule) {
  return errors::InvalidArgument("table_splits[", position, "] = ", value, " ", rule);
}

}  // namespace

Status GpuIdsLimit(const char* op, const char* what, int64_t count) {
  if (count > kMaxGpuIds) {
    return errors::InvalidArgument("the GPU kernel of ", op, " supports at most ", kMaxGpuIds, " ",
                                   what, ", got ", count);
  }
  return OkStatus();
}

Status ValidateGpuTTShape(const TTShape& shape) {
  if (shape.num_cores > kMaxTTCores) {
    return errors::InvalidArgument("the GPU TT kernels support at most ", kMaxTTCores,
                                   " cores, got num_cores = ", shape.num_cores);
  }
  if (shape.dim > (int64_t{1} << 31)) {
    return errors::InvalidArgument(
        "the GPU TT kernels support rows of at most 2^31 columns, got "
        "prod(q_shapes) = ",
        shape.dim);
  }
  return OkStatus();
}

Status GetUniqueIdsAttrs(OpKernelConstruction* ctx, UniqueIdsAttrs* attrs) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_embeddings", &attrs->num_embeddings));
  TF_RETURN_IF_ERROR(ctx->GetAttr("stride", &attrs->stride));
  TF_RETURN_IF_ERROR(ctx->GetAttr("padding_id", &attrs->bag.padding_id));
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_padding_id", &attrs->bag.has_padding_id));
  if (attrs->stride < attrs->num_embeddings) {
    return errors::InvalidArgument("stride (", attrs->stride, ") must be >= num_embeddings (",
                                   attrs->num_embeddings, ")");
  }
  return OkStatus();
}

Status ValidateUniqueIdsInputs(const Tensor& ids, const Tensor& table_splits,
                               const UniqueIdsAttrs& attrs) {
  TF_RETURN_IF_ERROR(CheckRank(ids, 1, "ids must be a vector [nnz]"));
  TF_RETURN_IF_ERROR(CheckSplitsShape(
      table_splits, 2, "table_splits must be a vector [num_tables + 1] with at least 2 elements"));
  const auto splits = table_splits.flat<int64_t>();
  const int64_t nnz = ids.NumElements();
  const int64_t num_tables = splits.size() - 1;
  if (splits(0) != 0) return TableSplitsError(0, splits(0), "must be 0");
  for (int64_t t = 0; t < num_tables; ++t) {
    if (splits(t + 1) < splits(t)) {
      return TableSplitsError(t + 1, splits(t + 1), "must be >= the previous split");
    }
  }
  if (splits(num_tables) != nnz) {
    return TableSplitsError(num_tables, splits(num_tables), "must equal the number of ids");
  }
  int64_t unused;
  return CheckedMul(num_tables, attrs.stride, "num_tables * stride", &unused);
}

Status ValidateGpuUniqueIdsSizes(int64_t nnz, int64_t num_tables, const UniqueIdsAttrs& attrs) {
  TF_RETURN_IF_ERROR(GpuIdsLimit("TTUniqueIds", "ids", nnz));
  if (attrs.stride > ((int64_t{1} << 62) - 1) / num_tables) {
    return errors::InvalidArgument("num_tables * stride is too large for the GPU kernel: ",
                                   num_tables, " * ", attrs.stride, " >= 2^62");
  }
  return OkStatus();
}

Status ValidateCacheCountIds(const Tensor& ids) {
  return CheckRank(ids, 1, "ids must be a vector");
}

namespace {

Status LookupInt64Vector(OpKernelContext* ctx, int input, const char* name,
                         core::RefCountPtr<Var>* var) {
  TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input), var));
  const Tensor* t = (*var)->tensor();
  if (t->dtype() != DT_INT64 || t->dims() != 1) {
    return errors::InvalidArgument(name, " must be an int64 vector variable, got ",
                                   DataTypeString(t->dtype()), " ", t->shape().DebugString());
  }
  if (!(*var)->is_initialized) {
    return errors::FailedPrecondition(name, " variable is not initialized");
  }
  return OkStatus();
}

}  // namespace

Status LookupCacheTables(OpKernelContext* ctx, core::RefCountPtr<Var>* keys,
                         core::RefCountPtr<Var>* counts) {
  TF_RETURN_IF_ERROR(LookupInt64Vector(ctx, 0, "keys", keys));
  TF_RETURN_IF_ERROR(LookupInt64Vector(ctx, 1, "counts", counts));
  if (keys->get() == counts->get()) {
    return errors::InvalidArgument("keys and counts must be different variables");
  }
  return OkStatus();
}

Status ValidateCacheTableSizes(Var* keys, Var* counts) {
  const int64_t size = keys->tensor()->NumElements();
  if (counts->tensor()->NumElements() != size) {
    return errors::InvalidArgument("keys and counts must have the same size, got ", size, " and ",
                                   counts->tensor()->NumElements());
  }
  return OkStatus();
}

}  // namespace tf_ttemb
}  // namespace tensorflow
