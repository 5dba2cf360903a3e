"""`gather_reduce_sum_sparse_apply`: a lookup whose backward pass applies an optimizer to
the rows it read, in place (the `TfTtemb>GatherReduceSumSparseApply` op).
"""

from __future__ import annotations

import tensorflow as tf

from tf_ttemb import _args
from tf_ttemb.ops import _bags, _common, _custom_op, _loader


def gather_reduce_sum_sparse_apply(
    params,
    indices: _common.IndicesLike,
    weights=None,
    *,
    trigger,
    optimizer: str = "sgd",
    learning_rate=0.01,
    accumulator=None,
    epsilon: float = 1e-7,
    combiner: str = "sum",
    padding_id: int | None = None,
    name: str | None = None,
) -> tf.Tensor:
    """`gather_reduce_sum` whose backward pass applies an optimizer to the rows it read.

    The forward result is `gather_reduce_sum(params, indices, weights, combiner,
    padding_id)`. When a gradient is taken through it, op `GatherReduceSumSparseApply`
    reduces the params gradient of each distinct row read (as `gather_reduce_sum`'s
    gradient would, duplicates summed) and applies `optimizer` to that row of the
    `params` variable in place, so the [U, D] params gradient is never materialised
    (FBGEMM's fused table-batched optimizers and FBTT's `sparse=True` do the same). With
    `g` a row's summed gradient, `lr = learning_rate`, `eps = epsilon`:

    * `"sgd"`: `w -= lr * g`
    * `"rowwise_adagrad"`: `a += mean(g**2)`; `w -= lr * g / (sqrt(a) + eps)`, with one
      accumulator per row (`accumulator` of shape [N]), as
      `tf_ttemb.optimizers.RowWiseAdagrad`
    * `"adagrad"`: `a += g**2`; `w -= lr * g / (sqrt(a) + eps)` per element
      (`accumulator` of shape [N, D])

    A row whose denominator is 0 has a zero gradient and is left unchanged. Rows not read
    (and padding entries) are untouched. The weights gradient is computed from the rows
    as they were before the update and returned as usual; `params` gets no gradient.

    The backward pass runs only if the tape reaches it through a differentiable input:
    the weights, or `trigger`, any float tensor (typically the value of an empty
    trainable variable, as `ProductKeyMemory(values_optimizer=...)` uses). `trigger`'s
    gradient is zeros of its shape, data-dependent on the update, so a step that applies
    that gradient also runs the update. Each gradient computation through the result
    updates the table once (a persistent tape asked twice updates twice).

    The op has CPU and GPU kernels, and runs where `params` lives (`accumulator` must live
    on the same device). Both give the same numbers up to the order of the sums within
    a row (each device's order is fixed: bitwise deterministic). It has no XLA kernel
    and raises under XLA compilation.

    Args:
      params: The [N, D] table as a resource variable (`tf.Variable` or Keras variable),
        float16, bfloat16, float32 or float64; updated in place.
      indices: Row ids as for `gather_reduce_sum` (dense [..., L], ragged or sparse).
      weights: Optional per-entry weights with the structure of `indices`.
      trigger: A float tensor through which tapes reach the update (see above).
      optimizer: "sgd", "rowwise_adagrad" or "adagrad".
      learning_rate: Python float or scalar tensor.
      accumulator: The optimizer state variable for the two Adagrads ([N] or [N, D],
        float32 for float16/bfloat16/float32 params, float64 for float64), else None.
      epsilon: Adagrad's epsilon, added to `sqrt(a)`, >= 0.
      combiner: "sum", "mean", "sqrtn" or "max" (max takes no weights).
      padding_id: Entries with this id are skipped (no contribution, no update).
      name: Optional name scope.

    Returns:
      The combined embeddings, as `gather_reduce_sum` returns them.

    Raises:
      ValueError: For an unknown choice, `params` or `accumulator` not a resource
        variable, an accumulator missing (Adagrads) or given (SGD), weights with max,
        use under XLA compilation or under a `tf.distribute` strategy.
      tf.errors.InvalidArgumentError: For bad ids (as `gather_reduce_sum`), an
        accumulator of the wrong shape or dtype, or a non-finite learning rate or a
        negative epsilon (raised by the backward pass).

    Example:

    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> from tf_ttemb.ops.sparse_apply import gather_reduce_sum_sparse_apply
    >>> table = tf.Variable(tf.ones([5, 2]))
    >>> trigger = tf.Variable(tf.zeros([0]))
    >>> with tf.GradientTape() as tape:
    ...     out = gather_reduce_sum_sparse_apply(
    ...         table, tf.constant([[0, 3], [3, 3]]), trigger=trigger, learning_rate=0.5)
    ...     loss = tf.reduce_sum(out)
    >>> tape.gradient(loss, trigger).shape  # runs the update
    TensorShape([0])
    >>> table[:, 0].numpy()  # row 0 read once, row 3 three times
    array([ 0.5,  1. ,  1. , -0.5,  1. ], dtype=float32)
    """
    padding_id = _common.check_lookup_args(combiner, weights, padding_id)
    variable = _common.resource_variable(params)
    if variable is None:
        raise ValueError(
            "params must be a resource variable (tf.Variable or Keras variable) updated in "
            f"place, got {type(params).__name__}"
        )
    state, epsilon = check_optimizer(
        optimizer, accumulator, epsilon, "gather_reduce_sum_sparse_apply"
    )
    dtype = tf.as_dtype(variable.dtype)
    shape = tf.TensorShape(variable.shape)
    _common.check_table(shape, dtype)
    with tf.name_scope(name or "gather_reduce_sum_sparse_apply"):
        bags = _bags.to_csr(indices, weights, dtype, xla=False)
        output = apply_on_bags(
            variable, state, bags, trigger, optimizer, learning_rate, epsilon, combiner, padding_id
        )
        return _bags.shaped_output(output, bags, shape[1:])


# Why a fused update cannot run under the strategies `check_strategy` refuses: (public
# name, reason), by the strategy's public class.
_REFUSED_STRATEGIES = (
    (
        "ParameterServerStrategy",
        "the tables live on parameter servers and workers' steps update them "
        "asynchronously; the fused update is not implemented there (train with sparse=False "
        "and an optimizer on the tables or their shards)",
    ),
    (
        "experimental.CentralStorageStrategy",
        "every replica reads the one copy of the table, so each replica would apply the "
        "replicas' summed update to it again",
    ),
    ("MultiWorkerMirroredStrategy", "it is not tested across workers (use MirroredStrategy)"),
    ("TPUStrategy", "the fused update is a custom op, which does not run on TPUs"),
)
FUSED_STRATEGIES = ("MirroredStrategy", "OneDeviceStrategy")


def check_strategy(what: str) -> None:
    """Raises ValueError naming the strategy unless there is none, or it is one under which
    a fused update gathers the replicas' bags (`FUSED_STRATEGIES`: each replica's copy of
    the table then takes the same update, from every replica's gradient, once)."""
    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy)):
        return
    name, reason = type(strategy).__name__, "it is not one of them"
    for public, why in _REFUSED_STRATEGIES:
        cls = tf.distribute
        for part in public.split("."):
            cls = getattr(cls, part, None)
        if isinstance(cls, type) and isinstance(strategy, cls):
            name, reason = public.split(".")[-1], why
            break
    raise ValueError(
        f"{what} supports the strategies {' and '.join(FUSED_STRATEGIES)} only, got {name}: "
        f"{reason}"
    )


def check_optimizer(
    optimizer: str, accumulator, epsilon: float, what: str, strategies: bool = False
):
    """The optimizer arguments of a fused update, checked: (state variable or None,
    epsilon as a float). Raises ValueError naming the argument, under XLA, and under a
    `tf.distribute` strategy, or with `strategies` under one `check_strategy` refuses
    (`what` names the caller)."""
    _args.check_choice("optimizer", optimizer, ("sgd", "rowwise_adagrad", "adagrad"))
    state = None
    if optimizer == "sgd":
        if accumulator is not None:
            raise ValueError("optimizer 'sgd' takes no accumulator, got one")
    else:
        state = None if accumulator is None else _common.resource_variable(accumulator)
        if state is None:
            raise ValueError(
                f"optimizer {optimizer!r} needs an accumulator resource variable, got "
                f"{type(accumulator).__name__}"
            )
    epsilon = float(epsilon)
    if not epsilon >= 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if strategies:
        check_strategy(what)
    elif tf.distribute.has_strategy():
        # A replica would update its own copy of a mirrored table with its own gradient.
        raise ValueError(
            f"{what} does not support tf.distribute strategies "
            "(replicas would update their copies of params apart)"
        )
    if _common.in_xla_context():
        raise ValueError(
            f"{what} has no XLA kernel; call it outside "
            "jit_compile (or update the table with an optimizer from gather_reduce_sum's "
            "gradient)"
        )
    return state, epsilon


def apply_on_bags(
    variable,
    state,
    bags: _bags.Bags,
    trigger,
    optimizer: str,
    learning_rate,
    epsilon: float,
    combiner: str,
    padding_id: int | None,
) -> tf.Tensor:
    """The [B, D] lookup of `bags` (CSR) whose backward pass updates `variable` in place."""
    dtype = tf.as_dtype(variable.dtype)
    acc_dtype = tf.float64 if dtype == tf.float64 else tf.float32
    lib = _loader.load_op_library()
    has_weights = bags.weights is not None
    attrs = _custom_op.op_attrs(combiner, has_weights, padding_id)
    ids, row_splits = bags.ids, bags.row_splits
    rate = tf.cast(tf.convert_to_tensor(learning_rate, dtype_hint=acc_dtype), acc_dtype)
    eps = tf.constant(epsilon, acc_dtype)
    trigger = tf.convert_to_tensor(trigger)
    inputs = [bags.weights] if has_weights else []
    inputs.append(trigger)

    @tf.custom_gradient
    def lookup(*inputs):
        flat_weights = inputs[0] if has_weights else tf.zeros([0], dtype)
        output, argmax = _custom_op.run_forward(
            lib, variable.handle, ids, row_splits, tf.stop_gradient(flat_weights), attrs, True
        )

        def grad(dy, variables=None):
            step = dict(
                grad=tf.cast(dy, dtype),
                indices=ids,
                row_splits=row_splits,
                weights=flat_weights,
                output=output,
                argmax=argmax,
            )
            replica = tf.distribute.get_replica_context()
            own = None
            if replica is not None and replica.num_replicas_in_sync > 1:
                step, own = _all_replicas(replica, step, has_weights, combiner == "max")
            weights_grad = lib.tf_ttemb_gather_reduce_sum_sparse_apply(
                params=variable.handle,
                learning_rate=rate,
                epsilon=eps,
                accumulators=[] if state is None else [state.handle],
                optimizer=optimizer,
                **step,
                **attrs,
            )
            if own is not None:  # this replica's entries among all replicas'
                weights_grad = weights_grad[own[0] : own[1]]
            # The trigger's zero gradient is read from the updated variable: a data
            # dependency, so the update runs wherever that gradient is used (Grappler
            # may drop an update reached through control dependencies only).
            with tf.control_dependencies([weights_grad]):
                stamp = variable.sparse_read(tf.zeros([0], tf.int32))  # [0, D]
            trigger_grad = tf.zeros_like(trigger) + tf.reduce_sum(tf.cast(stamp, trigger.dtype))
            grads = ([weights_grad] if has_weights else []) + [trigger_grad]
            return grads, [None] * len(variables or [])

        return output, grad

    return lookup(*inputs)


def _all_replicas(replica, step: dict, has_weights: bool, is_max: bool) -> tuple:
    """The inputs of a fused update (`step`: grad, indices, row_splits, weights, output,
    argmax of this replica's bags) for the bags of every replica in sync, replica after
    replica, and where this replica's entries are among them: (inputs, (begin, end)).

    Every replica runs the update on its own copy of the table with these same inputs, so
    each copy takes the same update, from the sum of the replicas' gradients (as an
    optimizer applies the replicas' summed gradients), once per step.
    """
    splits = step["row_splits"]
    nnz = splits[-1:]
    parts = dict(
        grad=step["grad"],
        indices=step["indices"],
        output=step["output"],
        lengths=splits[1:] - splits[:-1],
        nnz=nnz,
    )
    if has_weights:
        parts["weights"] = step["weights"]
    if is_max:  # positions within each bag ([0, D] for the other combiners)
        parts["argmax"] = step["argmax"]
    gathered = replica.all_gather(parts, axis=0)
    counts = gathered.pop("nnz")  # [replicas]
    lengths = gathered.pop("lengths")
    row_splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(lengths)], 0)
    begin = tf.reduce_sum(counts[: replica.replica_id_in_sync_group])
    return {**step, **gathered, "row_splits": row_splits}, (begin, begin + nnz[0])
