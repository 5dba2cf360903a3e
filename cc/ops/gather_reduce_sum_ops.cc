// Op registrations for the gather_reduce_sum family (EmbeddingBag).
//
// All ops work on the CSR form of a batch of bags:
//   params      [N, D]   the table
//   indices     [nnz]    row ids, bag b owns indices[row_splits[b]:row_splits[b+1]]
//   row_splits  [B + 1]  int64, row_splits[0] == 0, non-decreasing, row_splits[B] == nnz
//   weights     [nnz]    per-entry weights when has_weights, else an empty [0] tensor
// indices and weights may have any shape: they are read flat, in row-major order (nnz =
// indices' element count; weights needs as many elements), so that a dense [B, L] batch
// goes in as it is, with no reshape before the op. A weights gradient has weights' shape.
//
// output[b] = combine over j in bag b (indices[j] != padding_id) of weights[j] * params[indices[j]]
//   sum:   sum_j w_j e_j
//   mean:  sum_j w_j e_j / sum_j w_j        (count of non-padding entries when unweighted)
//   sqrtn: sum_j w_j e_j / sqrt(sum_j w_j^2)
//   max:   elementwise max_j e_j            (weights not allowed)
// A bag with no non-padding entries, or a zero denominator, gives zeros.

#include "cc/ops/shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace tf_ttemb {
namespace {

// Shapes shared by every op of the family: checks ranks, merges nnz between
// indices and weights, and returns num_bags (B) from row_splits.
Status BagInputShapes(InferenceContext* c, int indices_input, DimensionHandle* num_bags) {
  ShapeHandle indices, row_splits;
  TF_RETURN_IF_ERROR(BagVectorShapes(c, indices_input, &indices, &row_splits));
  return c->Subtract(c->Dim(row_splits, 0), 1, num_bags);
}

// D of the forward's params (input 0): from its shape [N, D] when it is a tensor, from
// the handle's shape when the variable's is known, else unknown.
template <bool kResource>
Status ForwardParamsDim(InferenceContext* c, DimensionHandle* dim) {
  *dim = c->UnknownDim();
  ShapeHandle params = c->input(0);
  if (kResource) {
    const auto* handle_data = c->input_handle_shapes_and_types(0);
    if (handle_data == nullptr || handle_data->empty()) return OkStatus();
    params = (*handle_data)[0].shape;
  }
  TF_RETURN_IF_ERROR(c->WithRank(params, 2, &params));
  *dim = c->Dim(params, 1);
  return OkStatus();
}

// Shape function of (Resource)GatherReduceSum: output [B, D], argmax [B, D] for
// combiner 'max' (else [0, D]) and the report.
template <bool kResource>
Status ForwardShapes(InferenceContext* c) {
  DimensionHandle dim, num_bags;
  TF_RETURN_IF_ERROR(ForwardParamsDim<kResource>(c, &dim));
  TF_RETURN_IF_ERROR(BagInputShapes(c, 1, &num_bags));
  c->set_output(0, c->Matrix(num_bags, dim));
  std::string combiner;
  TF_RETURN_IF_ERROR(c->GetAttr("combiner", &combiner));
  c->set_output(1, c->Matrix(combiner == "max" ? num_bags : c->MakeDim(0), dim));
  c->set_output(2, c->Vector(c->UnknownDim()));
  return OkStatus();
}

// Shapes of the params-gradient ops taking (grad [B, D], indices, row_splits, weights,
// argmax, num_rows scalar): checks them, merges B, and returns grad's shape.
Status ParamsGradInputShapes(InferenceContext* c, ShapeHandle* grad) {
  ShapeHandle num_rows;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, grad));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 0, &num_rows));
  DimensionHandle num_bags;
  TF_RETURN_IF_ERROR(BagInputShapes(c, 1, &num_bags));
  return c->Merge(c->Dim(*grad, 0), num_bags, &num_bags);
}

// Shapes of the ops taking (grad [B, D], params, indices, row_splits, weights,
// output [B, D]): D from params (input 1) when it is a tensor [N, D] (a variable's
// is left to grad and output), merged with grad's and output's into *dim; B merged
// with row_splits; returns weights' shape (the weights gradient's).
template <bool kResource>
Status WeightsGradInputShapes(InferenceContext* c, DimensionHandle* dim, ShapeHandle* weights) {
  *dim = c->UnknownDim();
  if (!kResource) {
    ShapeHandle params;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &params));
    *dim = c->Dim(params, 1);
  }
  ShapeHandle grad, output;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 2, &output));
  TF_RETURN_IF_ERROR(c->Merge(grad, output, &grad));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(grad, 1), *dim, dim));
  DimensionHandle num_bags;
  TF_RETURN_IF_ERROR(BagInputShapes(c, 2, &num_bags));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(grad, 0), num_bags, &num_bags));
  *weights = c->input(4);
  return OkStatus();
}

// Shape function of (Resource)GatherReduceSumWeightsGrad (kFused = false): weights_grad,
// of weights' shape; and of (Resource)GatherReduceSumFusedGrad (kFused): unique_indices
// [U] (or [0] with dense_grad), params_grad [?, D] and weights_grad.
template <bool kResource, bool kFused>
Status WeightsGradShapes(InferenceContext* c) {
  DimensionHandle dim;
  ShapeHandle weights;
  TF_RETURN_IF_ERROR(WeightsGradInputShapes<kResource>(c, &dim, &weights));
  if constexpr (kFused) {
    bool dense_grad;
    TF_RETURN_IF_ERROR(c->GetAttr("dense_grad", &dense_grad));
    c->set_output(0, c->Vector(dense_grad ? c->MakeDim(0) : c->UnknownDim()));
    c->set_output(1, c->Matrix(c->UnknownDim(), dim));
  }
  c->set_output(kFused ? 2 : 0, weights);
  return OkStatus();
}

}  // namespace

#define TF_TTEMB_BAG_ATTRS                                       \
  Attr("T: {half, bfloat16, float, double}")                     \
      .Attr("Tindices: {int32, int64}")                          \
      .Attr("combiner: {'sum', 'mean', 'sqrtn', 'max'} = 'sum'") \
      .Attr("has_weights: bool = false")                         \
      .Attr("padding_id: int = -1")                              \
      .Attr("has_padding_id: bool = false")

// The inputs and outputs of a forward whose params input is `params` ("params: T"
// for [N, D], or "params: resource" for a variable holding [N, D] of dtype T).
#define TF_TTEMB_FORWARD_SIGNATURE(params)               \
  Input(params)                                          \
      .Input("indices: Tindices") /* [nnz] */            \
      .Input("row_splits: int64") /* [B + 1] */          \
      .Input("weights: T")        /* [nnz] or [0] */     \
      .Output("output: T")        /* [B, D] */           \
      .Output("argmax: int32")    /* [B, D] or [0, D] */ \
      .Output("report: int64")    /* [0] on the CPU; see CheckBagReport */

// The inputs of the params-gradient ops.
#define TF_TTEMB_PARAMS_GRAD_INPUTS                                   \
  Input("grad: T")                /* [B, D] */                        \
      .Input("indices: Tindices") /* [nnz] */                         \
      .Input("row_splits: int64") /* [B + 1] */                       \
      .Input("weights: T")        /* [nnz] or [0] */                  \
      .Input("argmax: int32")     /* [B, D] for 'max', else [0, D] */ \
      .Input("num_rows: int64")   /* scalar N */

// The inputs of the ops that compute the weights gradient, with params as in
// TF_TTEMB_FORWARD_SIGNATURE.
#define TF_TTEMB_WEIGHTS_GRAD_INPUTS(params)    \
  Input("grad: T") /* [B, D] */                 \
      .Input(params)                            \
      .Input("indices: Tindices") /* [nnz] */   \
      .Input("row_splits: int64") /* [B + 1] */ \
      .Input("weights: T")        /* [nnz] */   \
      .Input("output: T")         /* [B, D] */

// The outputs of the fused params + weights gradient.
#define TF_TTEMB_FUSED_GRAD_OUTPUTS                                          \
  Output("unique_indices: Tindices") /* [U], or [0] with dense_grad */       \
      .Output("params_grad: T")      /* [U, D], or [N, D] with dense_grad */ \
      .Output("weights_grad: T")     /* weights' shape */                    \
      .Attr("dense_grad: bool = false")

// Forward. `argmax` is [B, D] for combiner 'max' (position of the winning
// entry inside its bag, -1 for a bag without entries) and [0, D] otherwise.
// `report`: the CPU kernel checks the ids and row_splits itself and returns an
// empty report; the GPU kernel queues its work and returns without waiting for
// the device, its findings in `report` (a DeviceReport, cuda/common_types.h).
// Bad ids never make it read out of bounds (they are skipped), and
// TfTtemb>CheckBagReport on the report raises the CPU kernel's InvalidArgument,
// off the path of everything that consumes `output`.
REGISTER_OP("TfTtemb>GatherReduceSum")
    .TF_TTEMB_FORWARD_SIGNATURE("params: T")
    .TF_TTEMB_BAG_ATTRS.SetShapeFn(ForwardShapes</*kResource=*/false>)
    .Doc(R"doc(
Fused embedding bag: gathers rows of `params` and combines them per bag
without materialising the gathered [nnz, D] tensor.
)doc");

// The Resource* variants read the table straight from a resource variable under
// its lock. Reading a variable as a tensor copies the whole [N, D] table on every
// read once the variable has been updated sparsely (TensorFlow switches it to
// copy-on-read mode), which would cancel the memory the fused op saves.
// `dense_grad` only selects the form of the registered gradient.
REGISTER_OP("TfTtemb>ResourceGatherReduceSum")
    .TF_TTEMB_FORWARD_SIGNATURE("params: resource")
    .Attr("dense_grad: bool = false")
    .TF_TTEMB_BAG_ATTRS.SetShapeFn(ForwardShapes</*kResource=*/true>)
    .Doc("GatherReduceSum reading params from a resource variable, without a copy.");

// Raises the CPU kernel's InvalidArgument for what a forward's `report` holds
// (nothing for an empty report, as the CPU forward returns). Stateful, so that a
// tf.function runs it although nothing consumes it; the GPU kernel finishes once
// the forward's work has run, with no TensorFlow thread waiting on the stream.
REGISTER_OP("TfTtemb>CheckBagReport")
    .Input("report: int64")  // [0] or a DeviceReport
    .Attr("padding_id: int = -1")
    .Attr("has_padding_id: bool = false")
    .SetIsStateful()
    .SetShapeFn(ReportInputShape)
    .Doc("Raises the InvalidArgument a GatherReduceSum report describes.");

// Gradient w.r.t. params as deduplicated IndexedSlices: `unique_indices` are
// the distinct non-padding ids sorted ascending, `values[u]` the summed
// gradient of row unique_indices[u]. Deterministic.
REGISTER_OP("TfTtemb>GatherReduceSumGrad")
    .TF_TTEMB_PARAMS_GRAD_INPUTS
    .Output("unique_indices: Tindices")  // [U]
    .Output("values: T")                 // [U, D]
    .TF_TTEMB_BAG_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad;
      TF_RETURN_IF_ERROR(ParamsGradInputShapes(c, &grad));
      DimensionHandle unique = c->UnknownDim();
      c->set_output(0, c->Vector(unique));
      c->set_output(1, c->Matrix(unique, c->Dim(grad, 1)));
      return OkStatus();
    })
    .Doc("Deduplicated sparse gradient of GatherReduceSum w.r.t. params.");

// Gradient w.r.t. params as a dense [N, D] tensor, written directly from the
// sorted, segment-reduced entries (no [nnz, D] intermediate).
REGISTER_OP("TfTtemb>GatherReduceSumDenseGrad")
    .TF_TTEMB_PARAMS_GRAD_INPUTS
    .Output("params_grad: T")  // [N, D]
    .TF_TTEMB_BAG_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad;
      TF_RETURN_IF_ERROR(ParamsGradInputShapes(c, &grad));
      DimensionHandle num_rows;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(5, &num_rows));
      c->set_output(0, c->Matrix(num_rows, c->Dim(grad, 1)));
      return OkStatus();
    })
    .Doc("Dense [N, D] gradient of GatherReduceSum w.r.t. params.");

// Gradient w.r.t. the per-entry weights (combiners sum, mean, sqrtn).
// `output` is the forward result, needed by mean and sqrtn. Padding entries
// get a zero gradient.
REGISTER_OP("TfTtemb>GatherReduceSumWeightsGrad")
    .TF_TTEMB_WEIGHTS_GRAD_INPUTS("params: T")
    .Output("weights_grad: T")  // weights' shape
    .TF_TTEMB_BAG_ATTRS.SetShapeFn(WeightsGradShapes</*kResource=*/false, /*kFused=*/false>)
    .Doc("Gradient of GatherReduceSum w.r.t. the per-entry weights.");

REGISTER_OP("TfTtemb>ResourceGatherReduceSumWeightsGrad")
    .TF_TTEMB_WEIGHTS_GRAD_INPUTS("params: resource")
    .Output("weights_grad: T")  // weights' shape
    .TF_TTEMB_BAG_ATTRS.SetShapeFn(WeightsGradShapes</*kResource=*/true, /*kFused=*/false>)
    .Doc("GatherReduceSumWeightsGrad reading params from a resource variable.");

// Fused backward for weighted sum/mean/sqrtn (CPU): the params gradient and the
// weights gradient in one pass over the entries grouped by id, so each table
// row is read once (in id order) instead of gathered again per entry.
// With dense_grad the params gradient is [N, D] and unique_indices is empty.
REGISTER_OP("TfTtemb>GatherReduceSumFusedGrad")
    .TF_TTEMB_WEIGHTS_GRAD_INPUTS("params: T")
    .TF_TTEMB_FUSED_GRAD_OUTPUTS.TF_TTEMB_BAG_ATTRS
    .SetShapeFn(WeightsGradShapes</*kResource=*/false, /*kFused=*/true>)
    .Doc("Params and weights gradients of a weighted GatherReduceSum in one pass.");

REGISTER_OP("TfTtemb>ResourceGatherReduceSumFusedGrad")
    .TF_TTEMB_WEIGHTS_GRAD_INPUTS("params: resource")
    .TF_TTEMB_FUSED_GRAD_OUTPUTS.TF_TTEMB_BAG_ATTRS
    .SetShapeFn(WeightsGradShapes</*kResource=*/true, /*kFused=*/true>)
    .Doc("GatherReduceSumFusedGrad reading params from a resource variable.");

// Backward with the optimizer fused in (CPU): the params gradient of each
// distinct row is reduced in one thread's [D] scratch and applied to the row
// of the `params` variable at once, so the [U, D] gradient is never built.
// `optimizer` (with lr = learning_rate, eps = epsilon, g = the row's summed
// gradient):
//   sgd:             w -= lr * g
//   rowwise_adagrad: a += mean(g^2) (a: [N]);    w -= lr g / (sqrt(a) + eps)
//   adagrad:         a += g^2 (a: [N, D]);       w -= lr g / (sqrt(a) + eps)
// A row whose denominator is 0 has a zero gradient and is left unchanged.
// Accumulators hold Tacc (float32 for half types and float32, float64 for
// float64), like learning_rate and epsilon. The weights gradient (has_weights)
// is computed from the rows as they were before the update; without weights
// it is an empty [0] vector. `output` is the forward result (used by weighted
// mean and sqrtn), `argmax` the forward's second output (used by max).
REGISTER_OP("TfTtemb>GatherReduceSumSparseApply")
    .TF_TTEMB_WEIGHTS_GRAD_INPUTS("params: resource")    // weights: [nnz] or [0]
    .Input("argmax: int32")                              // [B, D] for 'max', else [0, D]
    .Input("learning_rate: Tacc")                        // scalar
    .Input("epsilon: Tacc")                              // scalar, >= 0
    .Input("accumulators: num_accumulators * resource")  // 0 (sgd) or 1
    .Output("weights_grad: T")                           // weights' shape, [0] without weights
    .Attr("optimizer: {'sgd', 'rowwise_adagrad', 'adagrad'} = 'sgd'")
    .Attr("num_accumulators: int >= 0 = 0")
    .Attr("Tacc: {float, double} = DT_FLOAT")
    .TF_TTEMB_BAG_ATTRS.SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle dim;
      ShapeHandle weights, argmax, scalar;
      TF_RETURN_IF_ERROR(WeightsGradInputShapes</*kResource=*/true>(c, &dim, &weights));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(6), 2, &argmax));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(7), 0, &scalar));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(8), 0, &scalar));
      bool has_weights;
      TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
      c->set_output(0, has_weights ? weights : c->Vector(0));
      return OkStatus();
    })
    .Doc("GatherReduceSum backward applying an optimizer to the rows read.");

#undef TF_TTEMB_FUSED_GRAD_OUTPUTS
#undef TF_TTEMB_WEIGHTS_GRAD_INPUTS
#undef TF_TTEMB_PARAMS_GRAD_INPUTS
#undef TF_TTEMB_FORWARD_SIGNATURE
#undef TF_TTEMB_BAG_ATTRS

}  // namespace tf_ttemb
}  // namespace tensorflow
