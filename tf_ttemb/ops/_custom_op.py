"""The custom-op path of `gather_reduce_sum`: calls into the `TfTtemb>GatherReduceSum` op
family (`docs/gather_reduce_sum_contract.md`) and the gradients registered for it.

Private to the package; not an API.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_ttemb.ops import _bags, _common, _loader


def op_attrs(combiner, has_weights: bool, padding_id: int | None) -> dict:
    return {
        "combiner": combiner,
        "has_weights": has_weights,
        "padding_id": -1 if padding_id is None else padding_id,
        "has_padding_id": padding_id is not None,
    }


def run_forward(
    lib,
    params,
    ids,
    row_splits,
    weights,
    attrs: dict,
    resource: bool = False,
    checked: bool = False,
    **extra,
):
    """The forward op (`ResourceGatherReduceSum` on a variable's handle when `resource`),
    and the check of its report: (output, argmax).

    The GPU kernel returns without waiting for the device and leaves what it found wrong
    in the ids and row_splits in its `report` output; `CheckBagReport` raises the CPU
    kernel's InvalidArgument from it. Nothing consumes the check, so the output's
    consumers never wait for it: a tf.function runs it (it is stateful) and fails the
    call, and in eager mode it raises here; only in a TF1 graph does the output wait for
    it (`_common.after_checks`). Without a GPU the CPU kernel checks on its own and the
    report is empty, so no check is added. `checked`: the ids and row_splits come from an
    op that checked them already (GroupBags), so the report needs no check either.
    """
    op = lib.tf_ttemb_resource_gather_reduce_sum if resource else lib.tf_ttemb_gather_reduce_sum
    output, argmax, report = op(params, ids, row_splits, weights, **attrs, **extra)
    if _common.gpus_visible() and not checked:
        check = lib.tf_ttemb_check_bag_report(
            report, padding_id=attrs["padding_id"], has_padding_id=attrs["has_padding_id"]
        )
        output = _common.after_checks([check], output)
    return output, argmax


def _attrs_of(op) -> dict:
    return {
        key: op.get_attr(key) for key in ("combiner", "has_weights", "padding_id", "has_padding_id")
    }


def _forward_op_parts(op) -> tuple:
    """What a forward op's gradient reads: (lib, attrs, table, ids, row_splits, weights,
    output, argmax); the table is params, or the variable's handle."""
    return (_loader.load_op_library(), _attrs_of(op), *op.inputs[:4], *op.outputs[:2])


def _params_grad_sparse(lib, params_shape, ids, row_splits, weights, argmax, grad, attrs):
    """The two-op backward's params gradient: IndexedSlices over the sorted unique ids."""
    unique_ids, values = lib.tf_ttemb_gather_reduce_sum_grad(
        grad, ids, row_splits, weights, argmax, _common.shape_dim_on_host(params_shape), **attrs
    )
    return tf.IndexedSlices(values, unique_ids, dense_shape=params_shape)


def _weights_grad(lib, params, ids, row_splits, weights, output, grad, attrs):
    if not attrs["has_weights"]:
        return None
    return lib.tf_ttemb_gather_reduce_sum_weights_grad(
        grad, params, ids, row_splits, weights, output, **attrs
    )


@tf.RegisterGradient("TfTtemb>GatherReduceSum")
def _gather_reduce_sum_grad(op, grad, unused_argmax_grad, unused_report_grad):
    """Gradients of GatherReduceSum: IndexedSlices over sorted unique ids, weights, None."""
    lib, attrs, params, ids, row_splits, weights, output, argmax = _forward_op_parts(op)
    if _use_fused_backward(attrs):
        unique_ids, values, weights_grad = lib.tf_ttemb_gather_reduce_sum_fused_grad(
            grad, params, ids, row_splits, weights, output, dense_grad=False, **attrs
        )
        params_shape = tf.shape(params, out_type=tf.int64)
        return tf.IndexedSlices(values, unique_ids, params_shape), None, None, weights_grad
    params_shape = tf.shape(params, out_type=tf.int64)
    params_grad = _params_grad_sparse(
        lib, params_shape, ids, row_splits, weights, argmax, grad, attrs
    )
    weights_grad = _weights_grad(lib, params, ids, row_splits, weights, output, grad, attrs)
    return params_grad, None, None, weights_grad


def _use_fused_backward(attrs: dict) -> bool:
    """Whether the weighted backward can use the one-pass fused gradient op.

    It computes the params and weights gradients together, reading each table row once
    in id order instead of gathering it again per entry (CPU and GPU kernels).
    """
    return attrs["has_weights"] and attrs["combiner"] != "max"


@tf.RegisterGradient("TfTtemb>ResourceGatherReduceSum")
def _resource_gather_reduce_sum_grad(op, grad, unused_argmax_grad, unused_report_grad):
    """Gradients of ResourceGatherReduceSum, as for GatherReduceSum, w.r.t. the handle."""
    lib, attrs, handle, ids, row_splits, weights, output, argmax = _forward_op_parts(op)
    params_shape = tf.raw_ops.VariableShape(input=handle, out_type=tf.int64)
    if _use_fused_backward(attrs):
        dense_grad = op.get_attr("dense_grad")
        unique_ids, values, weights_grad = lib.tf_ttemb_resource_gather_reduce_sum_fused_grad(
            grad, handle, ids, row_splits, weights, output, dense_grad=dense_grad, **attrs
        )
        if dense_grad:
            return values, None, None, weights_grad
        return tf.IndexedSlices(values, unique_ids, params_shape), None, None, weights_grad
    if op.get_attr("dense_grad"):
        params_grad = lib.tf_ttemb_gather_reduce_sum_dense_grad(
            grad, ids, row_splits, weights, argmax, _common.shape_dim_on_host(params_shape), **attrs
        )
    else:
        params_grad = _params_grad_sparse(
            lib, params_shape, ids, row_splits, weights, argmax, grad, attrs
        )
    weights_grad = None
    if attrs["has_weights"]:
        weights_grad = lib.tf_ttemb_resource_gather_reduce_sum_weights_grad(
            grad, handle, ids, row_splits, weights, output, **attrs
        )
    return params_grad, None, None, weights_grad


def _forward_inputs(bags: _bags.Bags, combiner: str, padding_id: int | None, table) -> tuple:
    """(lib, attrs, weights) of a forward op on `table`'s dtype and device: the bags'
    weights, or an empty tensor when they have none."""
    has_weights = bags.weights is not None
    attrs = op_attrs(combiner, has_weights, padding_id)
    weights = bags.weights if has_weights else _common.empty(table.dtype, table.device)
    return _loader.load_op_library(), attrs, weights


def custom_op_on_variable(
    variable: tf.Variable,
    bags: _bags.Bags,
    combiner: str,
    padding_id: Optional[int],
    dense_grad: bool,
    checked: bool = False,
) -> tf.Tensor:
    """The forward on a variable's handle (`ResourceGatherReduceSum`): output [B, D]."""
    lib, attrs, weights = _forward_inputs(bags, combiner, padding_id, variable)
    # A read of no rows, through the public API, tells every active GradientTape that
    # the variable was used (the op below reads it through its handle, which tapes do
    # not see as a variable access). In a graph it costs nothing (nothing reads it);
    # eagerly it is one more op per call, so it runs only where a tape may record.
    if not tf.executing_eagerly() or _common.tape_may_record():
        variable.sparse_read(_common.empty(tf.int32, variable.device))
    output, _ = run_forward(
        lib,
        variable.handle,
        bags.ids,
        bags.row_splits,
        weights,
        attrs,
        True,
        checked,
        dense_grad=dense_grad,
    )
    return output


def bound_forward(params: tf.Tensor, bags: _bags.Bags, combiner: str, padding_id: int | None):
    """`custom_op`'s forward (sparse gradient) with its op attrs fixed: a function
    (params, ids, row_splits, weights) -> output [B, D] for another call with the
    combiner and padding_id of this one and a table of the same dtype and device
    (weights None where `bags` has none)."""
    lib, attrs, empty_weights = _forward_inputs(bags, combiner, padding_id, params)

    def forward(params, ids, row_splits, weights):
        weights = empty_weights if weights is None else weights
        return run_forward(lib, params, ids, row_splits, weights, attrs)[0]

    return forward


def custom_op(
    params: tf.Tensor,
    bags: _bags.Bags,
    combiner: str,
    padding_id: int | None,
    dense_grad: bool,
    checked: bool = False,
) -> tf.Tensor:
    """The forward on a table tensor (`GatherReduceSum`): output [B, D]; with `dense_grad`
    its params gradient is dense."""
    lib, attrs, weights = _forward_inputs(bags, combiner, padding_id, params)
    ids, row_splits = bags.ids, bags.row_splits
    if not dense_grad:
        output, _ = run_forward(lib, params, ids, row_splits, weights, attrs, checked=checked)
        return output

    # The op has no attr for the gradient's form, so the dense-gradient variant replaces
    # the registered (sparse) gradient with one that calls GatherReduceSumDenseGrad.
    @tf.custom_gradient
    def forward(params, weights):
        # stop_gradient: the registered gradient is replaced, so an eager tape need not
        # record the inner op.
        output, argmax = run_forward(
            lib,
            tf.stop_gradient(params),
            ids,
            row_splits,
            tf.stop_gradient(weights),
            attrs,
            checked=checked,
        )

        def grad(dy):
            if _use_fused_backward(attrs):
                _, params_grad, weights_grad = lib.tf_ttemb_gather_reduce_sum_fused_grad(
                    dy, params, ids, row_splits, weights, output, dense_grad=True, **attrs
                )
                return params_grad, weights_grad
            params_grad = lib.tf_ttemb_gather_reduce_sum_dense_grad(
                dy,
                ids,
                row_splits,
                weights,
                argmax,
                _common.shape_dim_on_host(tf.shape(params, out_type=tf.int64)),
                **attrs,
            )
            weights_grad = _weights_grad(lib, params, ids, row_splits, weights, output, dy, attrs)
            return params_grad, weights_grad

        return output, grad

    return forward(params, weights)


tf.no_gradient("TfTtemb>CheckBagReport")
tf.no_gradient("TfTtemb>GatherReduceSumGrad")
tf.no_gradient("TfTtemb>GatherReduceSumFusedGrad")
tf.no_gradient("TfTtemb>ResourceGatherReduceSumFusedGrad")
tf.no_gradient("TfTtemb>ResourceGatherReduceSumWeightsGrad")
tf.no_gradient("TfTtemb>GatherReduceSumDenseGrad")
tf.no_gradient("TfTtemb>GatherReduceSumWeightsGrad")
