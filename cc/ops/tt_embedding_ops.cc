// Op registrations for the TT (tensor-train) embedding family.
//
// A table of N rows and D = prod(q) columns is num_cores cores; core k is
//   [num_tables * p_k, r_k * q_k * r_{k+1}]   (r_0 = r_T = 1, ranks = r_1..r_{T-1})
// and row d of it is the block G_k[d] of shape (r_k, q_k, r_{k+1}), row-major.
// Rows of all tables are addressed by a global id g = table * prod(p) + row.
// See docs/tt_embedding_contract.md.
//
//   TTUniqueIds  flat ids [nnz] + table_splits -> sorted distinct global ids [U]
//                and the slot of each entry in them (-1 for padding)
//   TTRows       ids [U] -> rows [U, D], decompressing only those rows (and
//                the partial products the gradient needs, when they fit)
//   TTRowsGrad   ids [U], grad [U, D] -> per core, IndexedSlices of its gradient
//   TTRowsBagsGrad  the same from the gradient of gather_reduce_sum(rows, slots,
//                row_splits, weights) [B, D], without the rows' gradient [U, D]
//                (CPU only)
//   TTCacheCount counts ids in a bounded set-associative frequency table

#include "cc/ops/shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace tf_ttemb {

namespace {

// Checks the TT attrs' lengths and returns D = prod(q_shapes).
Status TTAttrShapes(InferenceContext* c, int64_t* dim) {
  int64_t num_cores;
  std::vector<int64_t> p_shapes, q_shapes, ranks;
  TF_RETURN_IF_ERROR(c->GetAttr("num_cores", &num_cores));
  TF_RETURN_IF_ERROR(c->GetAttr("p_shapes", &p_shapes));
  TF_RETURN_IF_ERROR(c->GetAttr("q_shapes", &q_shapes));
  TF_RETURN_IF_ERROR(c->GetAttr("ranks", &ranks));
  if (static_cast<int64_t>(p_shapes.size()) != num_cores ||
      static_cast<int64_t>(q_shapes.size()) != num_cores ||
      static_cast<int64_t>(ranks.size()) != num_cores - 1) {
    return errors::InvalidArgument("p_shapes and q_shapes need num_cores = ", num_cores,
                                   " entries and ranks num_cores - 1, got ", p_shapes.size(), ", ",
                                   q_shapes.size(), " and ", ranks.size());
  }
  *dim = 1;
  for (int64_t q : q_shapes) {
    if (q < 1) return errors::InvalidArgument("q_shapes must be >= 1, got ", q);
    *dim *= q;
  }
  return OkStatus();
}

// Input shapes of TTRows and TTRowsGrad: ids [U] and cores of rank 2 whose
// second dimension is r_k * q_k * r_{k+1}.
Status TTRowsInputShapes(InferenceContext* c, int64_t* dim, ShapeHandle* ids) {
  TF_RETURN_IF_ERROR(TTAttrShapes(c, dim));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, ids));
  std::vector<int64_t> q_shapes, ranks;
  TF_RETURN_IF_ERROR(c->GetAttr("q_shapes", &q_shapes));
  TF_RETURN_IF_ERROR(c->GetAttr("ranks", &ranks));
  const int num_cores = static_cast<int>(q_shapes.size());
  for (int k = 0; k < num_cores; ++k) {
    ShapeHandle core;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(1 + k), 2, &core));
    const int64_t r_in = k == 0 ? 1 : ranks[k - 1];
    const int64_t r_out = k == num_cores - 1 ? 1 : ranks[k];
    DimensionHandle width;
    TF_RETURN_IF_ERROR(c->WithValue(c->Dim(core, 1), r_in * q_shapes[k] * r_out, &width));
  }
  return OkStatus();
}

// The shapes of TTRowsGrad and TTRowsBagsGrad: their inputs' (TTRowsInputShapes; grad,
// input 1 + num_cores, a matrix [?, D], returned) and their outputs (per core k, its
// touched rows [n_k] and their gradients [n_k, width_k]).
Status CoreGradShapes(InferenceContext* c, ShapeHandle* ids, ShapeHandle* grad) {
  int64_t dim, num_cores;
  TF_RETURN_IF_ERROR(TTRowsInputShapes(c, &dim, ids));
  TF_RETURN_IF_ERROR(c->GetAttr("num_cores", &num_cores));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1 + num_cores), 2, grad));
  DimensionHandle unused;
  TF_RETURN_IF_ERROR(c->WithValue(c->Dim(*grad, 1), dim, &unused));
  for (int64_t k = 0; k < num_cores; ++k) {
    DimensionHandle count = c->UnknownDim();
    c->set_output(k, c->Vector(count));
    c->set_output(num_cores + k, c->Matrix(count, c->Dim(c->input(1 + k), 1)));
  }
  return OkStatus();
}

}  // namespace

// The factorisation and value type of TTRows and TTRowsGrad.
#define TF_TTEMB_TT_ATTRS               \
  Attr("p_shapes: list(int) >= 2")      \
      .Attr("q_shapes: list(int) >= 2") \
      .Attr("ranks: list(int) >= 1")    \
      .Attr("num_tables: int >= 1 = 1") \
      .Attr("num_cores: int >= 2")      \
      .Attr("T: {half, bfloat16, float, double}")

REGISTER_OP("TfTtemb>TTUniqueIds")
    .Input("ids: Tindices")        // [nnz]
    .Input("table_splits: int64")  // [num_tables + 1]
    .Output("unique_ids: int64")   // [U] sorted distinct global ids
    .Output("slots: Tindices")     // [nnz] position in unique_ids, -1 = padding
    .Attr("num_embeddings: int >= 1")
    .Attr("stride: int >= 1")
    .Attr("padding_id: int = -1")
    .Attr("has_padding_id: bool = false")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, splits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, ids);
      return OkStatus();
    })
    .Doc(R"doc(
Distinct global ids of a batch (table * stride + id, sorted) and each entry's slot.

ids: Flat ids of all tables; entries table_splits[t]..table_splits[t+1]-1 are
  table t's. Each must be in [0, num_embeddings) or be the padding id.
table_splits: int64 [num_tables + 1], 0, non-decreasing, ending at nnz.
unique_ids: Sorted distinct global ids of the non-padding entries.
slots: Position of each entry's global id in unique_ids, -1 for padding entries.
)doc");

REGISTER_OP("TfTtemb>TTRows")
    .Input("ids: int64")            // [U] global ids
    .Input("cores: num_cores * T")  // core k: [num_tables * p_k, r_k q_k r_{k+1}]
    .Output("rows: T")              // [U, prod(q_shapes)]
    .Output("saved: T")             // [0]: kept for graphs that pass it to TTRowsGrad
    .Output("report: int64")        // [0] on the CPU; see CheckTTRowsReport
    .TF_TTEMB_TT_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(TTRowsInputShapes(c, &dim, &ids));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), dim));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Vector(c->UnknownDim()));
      return OkStatus();
    })
    .Doc(R"doc(
Rows of a TT-compressed table, decompressing only the requested ones.

ids: Global ids in [0, num_tables * prod(p_shapes)), any order; sorted distinct
  ids share the partial products of their leading digits.
rows: rows[u] = the table row of ids[u].
saved: Empty. TTRowsGrad recomputes the partial products it needs, which costs
  less than writing them out here and reading them back there; the output stays
  so that graphs that pass it to TTRowsGrad keep their signature.
report: Empty from the CPU kernel, which raises for a bad id itself. The GPU
  kernel queues its work and returns without waiting for the device; what it
  found wrong in the ids is in this TTReport (16 words, cuda/common_types.h),
  which CheckTTRowsReport turns into the CPU kernel's InvalidArgument.
)doc");

// Raises the CPU kernel's InvalidArgument for what a TTRows `report` holds (nothing for
// an empty report). Stateful, so that a tf.function runs it although nothing consumes it.
REGISTER_OP("TfTtemb>CheckTTRowsReport")
    .Input("report: int64")   // [0] or a TTReport
    .Attr("limit: int >= 1")  // valid global ids are [0, limit): num_tables * prod(p_shapes)
    .SetIsStateful()
    .SetShapeFn(ReportInputShape)
    .Doc("Raises the InvalidArgument a TTRows report describes.");

REGISTER_OP("TfTtemb>TTRowsGrad")
    .Input("ids: int64")  // [U]
    .Input("cores: num_cores * T")
    .Input("grad: T")                                // [U, D]
    .Input("saved: T")                               // not read (TTRows' empty output 1)
    .Output("core_grad_indices: num_cores * int64")  // core k: [n_k]
    .Output("core_grad_values: num_cores * T")       // core k: [n_k, width_k]
    .TF_TTEMB_TT_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, grad, saved;
      TF_RETURN_IF_ERROR(CoreGradShapes(c, &ids, &grad));
      DimensionHandle unused;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(grad, 0), c->Dim(ids, 0), &unused));
      return c->WithRank(c->input(c->num_inputs() - 1), 1, &saved);
    })
    .Doc(R"doc(
Gradients of TTRows w.r.t. every core, as IndexedSlices per core.

grad: Gradient w.r.t. rows.
saved: Not read: the partial products are recomputed from ids and cores. Pass
  TTRows' `saved` output or any vector.
core_grad_indices: For core k, the sorted distinct core rows touched by ids.
core_grad_values: For core k, their gradients. Summed in a fixed order: the
  result is bitwise identical from run to run.
)doc");

// TTRowsGrad fused with gather_reduce_sum's dense params gradient: the cores'
// gradients of gather_reduce_sum(TTRows(ids, cores), slots, row_splits, weights,
// combiner) from its output's gradient, each unique id's row gradient summed from
// its entries where the TT backward reads it. CPU only.
REGISTER_OP("TfTtemb>TTRowsBagsGrad")
    .Input("ids: int64")  // [U]
    .Input("cores: num_cores * T")
    .Input("grad: T")                                // [B, D]
    .Input("slots: Tindices")                        // [nnz] in [0, U), -1 = padding
    .Input("row_splits: int64")                      // [B + 1]
    .Input("weights: T")                             // [nnz], or [0] without weights
    .Output("core_grad_indices: num_cores * int64")  // as TTRowsGrad's
    .Output("core_grad_values: num_cores * T")
    .TF_TTEMB_TT_ATTRS.Attr("Tindices: {int32, int64}")
    .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")
    .Attr("has_weights: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, grad, row_splits;
      TF_RETURN_IF_ERROR(CoreGradShapes(c, &ids, &grad));
      return c->WithRank(c->input(c->num_inputs() - 2), 1, &row_splits);
    })
    .Doc(R"doc(
Gradients w.r.t. every core of gather_reduce_sum(TTRows(ids, cores), slots,
row_splits, weights, combiner), as IndexedSlices per core (as TTRowsGrad's).

grad: Gradient w.r.t. the bags' output [B, D].
slots: The bags' entries, as positions in ids; -1 marks padding.
row_splits: int64 [B + 1], 0, non-decreasing, ending at nnz.
weights: Per-entry weights when has_weights, else an empty [0] tensor.
)doc");

REGISTER_OP("TfTtemb>TTCacheCount")
    .Input("keys: resource")    // int64 [H], -1 = empty
    .Input("counts: resource")  // int64 [H]
    .Input("ids: int64")        // [n], negative ids are skipped
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      return c->WithRank(c->input(2), 1, &ids);
    })
    .Doc(R"doc(
Adds the ids of a batch to a bounded frequency table (space-saving sets).

keys: Variable int64 [H]: the id held by each slot, -1 when empty.
counts: Variable int64 [H]: its count.
ids: Ids to count; each distinct id adds its multiplicity. Slots form sets of
  min(32, H) ways chosen by a hash of the id; an id not in its set takes an
  empty way, else replaces the way with the smallest count and gets that
  count plus its multiplicity.
)doc");

}  // namespace tf_ttemb
}  // namespace tensorflow
