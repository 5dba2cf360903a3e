"""The composite implementation of `gather_reduce_sum`: plain TensorFlow ops that also
compile under XLA and run on TPU. Rows are gathered, weighted and segment-reduced a chunk
of entries at a time, forward and backward, so the gathered [nnz, D] tensor is never
built.

Its one setting is `COMPOSITE_CHUNK_BYTES` (read when a lookup is built); the functions
are the package's building blocks, called through `tf_ttemb.gather_reduce_sum(...,
implementation="composite")`, not an API of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from tf_ttemb.ops import _bags, _common

# Memory budget of the composite implementation, in bytes: a chunk of entries is sized so
# that one [chunk, D] temporary of the accumulation dtype (float32 for float16/bfloat16
# params) fits in it (int64 for the position bookkeeping of combiner "max"). A chunk step
# holds a few such temporaries at once, and chunks run one after another
# (parallel_iterations=1), so the extra memory is a small multiple of this budget plus
# the [B, D] accumulator (two for "max": values and NaN/-inf kinds) and O(nnz)
# integer/weight vectors, whatever nnz is. Gradients
# additionally hold their result: [U, D] (or [N, D] for dense gradients) in the
# accumulation dtype.
COMPOSITE_CHUNK_BYTES = 64 * 1024 * 1024


def composite(
    params: tf.Tensor,
    bags: _bags.Bags,
    combiner: str,
    padding_id: int | None,
    dense_grad: bool,
    xla: bool,
) -> tuple[tf.Tensor, Callable]:
    """gather_reduce_sum from plain TensorFlow ops, chunked forward and backward.

    Returns the [B, D] output and `backward(dy, weights_wanted) -> (params_grad,
    weights_grad)` for `tf.custom_gradient`. `xla`: ids outside [0, N) are treated like
    padding instead of raising (asserts do not survive XLA compilation), and the params
    gradient is dense (tf.unique does not compile).
    """
    # Runs inside tf.custom_gradient, which supplies the gradient; without these an eager
    # GradientTape would also record every chunk's ops and keep all their [chunk, D]
    # intermediates alive until the backward pass.
    params = tf.stop_gradient(params)
    if bags.weights is not None:
        bags = bags._replace(weights=tf.stop_gradient(bags.weights))
    dtype = params.dtype
    acc_dtype = _common.accumulation_dtype(dtype)
    ids_dtype = bags.ids.dtype
    ids = tf.cast(bags.ids, tf.int64)
    params_shape = tf.shape(params, out_type=tf.int64)
    num_rows = params_shape[0]
    dim = _common.static_or_dynamic(params.shape[1], tf.shape(params)[1])
    nnz = _common.static_or_dynamic(bags.ids.shape[0], tf.shape(ids, out_type=tf.int64)[0])
    static_bags = bags.row_splits.shape[0]
    num_bags = _common.static_or_dynamic(
        None if static_bags is None else static_bags - 1,
        tf.shape(bags.row_splits, out_type=tf.int64)[0] - 1,
    )
    # Segment num_bags is a dummy bag that absorbs padding, invalid ids and the slack
    # of the last chunk, so every chunk has the same static shape.
    dummy = num_bags

    not_padding = tf.ones_like(ids, tf.bool) if padding_id is None else ids != padding_id
    valid = not_padding & (ids >= 0) & (ids < num_rows)
    checks = [] if xla else _bags.bounds_check(ids, num_rows, padding_id)
    with tf.control_dependencies(checks):
        safe_ids = tf.where(valid, ids, tf.zeros_like(ids))
    segments = bags.segment_ids()
    entry_bags = tf.where(valid, segments, tf.cast(dummy, tf.int64) * tf.ones_like(segments))

    # Per-entry weights with the combiner's per-bag scale folded in.
    if bags.weights is None:
        raw_weights = tf.cast(valid, acc_dtype)
    else:
        raw_weights = tf.where(valid, tf.cast(bags.weights, acc_dtype), tf.zeros([], acc_dtype))
    scale = None  # [B + 1], 1/denominator per bag, 0 for the dummy bag and zero denominators
    if combiner in ("mean", "sqrtn"):
        terms = raw_weights if combiner == "mean" else tf.square(raw_weights)
        denominator = tf.math.unsorted_segment_sum(terms, entry_bags, num_bags + 1)
        if combiner == "sqrtn":
            denominator = tf.sqrt(denominator)
        # The dummy bag only holds zero weights, so its scale is 0 too.
        scale = tf.math.divide_no_nan(tf.ones_like(denominator), denominator)
        entry_weights = raw_weights * tf.gather(scale, entry_bags)
    else:
        entry_weights = raw_weights

    # Chunks of `chunk` entries: vectors padded to num_chunks * chunk and viewed as rows.
    itemsize = 8 if combiner == "max" else acc_dtype.size
    if isinstance(dim, int):
        chunk = max(1, COMPOSITE_CHUNK_BYTES // (max(dim, 1) * itemsize))
    else:
        chunk = tf.maximum(
            tf.constant(1, tf.int64),
            COMPOSITE_CHUNK_BYTES // (tf.maximum(tf.cast(dim, tf.int64), 1) * itemsize),
        )
    if isinstance(nnz, int) and isinstance(chunk, int):
        chunk = min(chunk, max(nnz, 1))
        num_chunks = -(-nnz // chunk)
        stored_chunks = max(num_chunks, 1)
    else:
        chunk = tf.minimum(tf.cast(chunk, tf.int64), tf.maximum(tf.cast(nnz, tf.int64), 1))
        num_chunks = (nnz + chunk - 1) // chunk
        stored_chunks = tf.maximum(num_chunks, 1)
    # At least one chunk is stored (all slack when there are no entries): XLA compiles the
    # loop body's slice of a chunk even when the loop runs no iteration.
    slack = stored_chunks * chunk - nnz

    if isinstance(chunk, int) and isinstance(stored_chunks, int):
        chunked_shape = [stored_chunks, chunk]
    else:
        chunked_shape = tf.stack([stored_chunks, chunk])

    def chunked(vector, fill):
        padded = tf.concat([vector, tf.fill(tf.reshape(slack, [1]), fill)], axis=0)
        return tf.reshape(padded, chunked_shape)

    ids_c = chunked(safe_ids, tf.constant(0, tf.int64))
    bags_c = chunked(entry_bags, tf.cast(dummy, tf.int64))
    weights_c = chunked(entry_weights, tf.constant(0, acc_dtype))

    def positions_of(k):
        return tf.cast(k * chunk, tf.int64) + tf.range(tf.cast(chunk, tf.int64))  # [chunk]

    # Invalid and padding entries gather row 0 (with weight 0, into the dummy bag). A
    # table without rows has no row 0: gather from one zero row instead (every entry is
    # then padding, or an id the bounds check rejected). Under XLA gathers clamp.
    table = params
    if not xla and (params.shape[0] is None or params.shape[0] == 0):
        table = tf.cond(
            num_rows > 0, lambda: params, lambda: tf.zeros(tf.stack([1, dim]), params.dtype)
        )

    def rows_of(k):
        return tf.cast(tf.gather(table, ids_c[k]), acc_dtype)  # [chunk, D]

    def loop(body, state):
        def step(k, *state):
            new_state = tuple(body(k, *state))
            for old, new in zip(state, new_state):
                # `acc + segment_sum(...)` broadcasts a static dim of 1 with the unknown
                # one to unknown; the state keeps its shape (while_loop demands it).
                if isinstance(new, tf.Tensor):
                    new.set_shape(old.shape)
            return (k + 1,) + new_state

        result = tf.while_loop(
            lambda k, *_: k < num_chunks,
            step,
            (tf.constant(0, tf.int64),) + tuple(state),
            parallel_iterations=1,
        )
        return result[1:]

    acc_shape = tf.stack([tf.cast(num_bags, tf.int64) + 1, tf.cast(dim, tf.int64)])
    if combiner == "max":
        # NaN wins and -inf is a value, as in the custom op and tf.reduce_max, whatever
        # the order of the entries and however a backend's segment max treats NaN (XLA's
        # may drop it) and its start (the lowest finite value). Per (bag, column): the max
        # of the entries that are not NaN, and the highest kind among the entries: 2 NaN,
        # 1 a value above -inf, 0 -inf; -1 while the bag has none.
        lowest = tf.constant(acc_dtype.min, acc_dtype)

        def max_step(k, acc, kind):
            rows = rows_of(k)
            is_nan = tf.math.is_nan(rows)
            entry_kind = tf.where(
                is_nan,
                tf.constant(2, acc_dtype),
                tf.where(
                    tf.equal(rows, -float("inf")),
                    tf.constant(0, acc_dtype),
                    tf.constant(1, acc_dtype),
                ),
            )
            values = tf.where(is_nan, lowest, rows)
            return (
                tf.maximum(acc, tf.math.unsorted_segment_max(values, bags_c[k], num_bags + 1)),
                tf.maximum(kind, tf.math.unsorted_segment_max(entry_kind, bags_c[k], num_bags + 1)),
            )

        acc, kind = loop(
            max_step, (tf.fill(acc_shape, lowest), tf.fill(acc_shape, tf.constant(-1, acc_dtype)))
        )
        acc = tf.where(tf.equal(kind, 2), tf.constant(float("nan"), acc_dtype), acc)
        acc = tf.where(tf.equal(kind, 0), tf.constant(-float("inf"), acc_dtype), acc)
        acc = tf.where(kind < 0, tf.zeros([], acc_dtype), acc)  # bags without entries
    else:

        def sum_step(k, acc):
            weighted = rows_of(k) * weights_c[k][:, None]
            return (acc + tf.math.unsorted_segment_sum(weighted, bags_c[k], num_bags + 1),)

        (acc,) = loop(sum_step, (tf.zeros(acc_shape, acc_dtype),))
        if scale is not None:
            # A bag of scale 0 (zero denominator) gives +0 whatever its rows hold (0 * Inf).
            acc = tf.where(tf.equal(scale, 0)[:, None], tf.zeros([], acc_dtype), acc)
    # acc: [B + 1, D] in acc_dtype; row B (the dummy bag) is garbage.

    sparse_params_grad = not (xla or dense_grad)

    def backward(dy: tf.Tensor, weights_wanted: bool):
        dy_pad = tf.concat([tf.cast(dy, acc_dtype), tf.zeros(tf.stack([1, dim]), acc_dtype)], 0)
        if sparse_params_grad:
            unique_ids = tf.sort(tf.unique(tf.boolean_mask(ids, valid)).y)
            num_slots = tf.shape(unique_ids, out_type=tf.int64)[0]
            slots_c = chunked(
                tf.searchsorted(unique_ids, safe_ids, side="left", out_type=tf.int64),
                tf.constant(0, tf.int64),
            )
            targets_c, num_targets = slots_c, num_slots + 1
        else:
            # Invalid and padding entries (zero contributions) target no row: a segment id
            # of -1 is dropped, also when the table has no rows.
            targets_c = chunked(tf.where(valid, ids, -tf.ones_like(ids)), tf.constant(-1, tf.int64))
            num_targets = num_rows
        grad_shape = tf.stack([num_targets, tf.cast(dim, tf.int64)])

        if combiner == "max":
            # Pass 1: per (bag, dim), the first position whose value equals the max (is
            # NaN, for a NaN max).
            never = tf.cast(num_chunks * chunk, tf.int64)

            def argmax_step(k, first):
                rows, best = rows_of(k), tf.gather(acc, bags_c[k])
                hit = tf.equal(rows, best) | (tf.math.is_nan(rows) & tf.math.is_nan(best))
                pos = tf.where(hit, positions_of(k)[:, None], never)
                return (
                    tf.minimum(first, tf.math.unsorted_segment_min(pos, bags_c[k], num_bags + 1)),
                )

            (first,) = loop(argmax_step, (tf.fill(acc_shape, never),))

            # Pass 2: that entry gets dy.
            def max_grad_step(k, grad_acc):
                bags_k = bags_c[k]
                won = tf.equal(tf.gather(first, bags_k), positions_of(k)[:, None])
                contrib = tf.where(won, tf.gather(dy_pad, bags_k), tf.zeros([], acc_dtype))
                return (
                    grad_acc + tf.math.unsorted_segment_sum(contrib, targets_c[k], num_targets),
                )

            (grad_acc,) = loop(max_grad_step, (tf.zeros(grad_shape, acc_dtype),))
            weights_grad = None
        else:
            if weights_wanted:
                # d out_b / d w_j = (e_j - out_b) / W_b (mean), (e_j - w_j out_b / Q_b) / Q_b
                # (sqrtn), e_j (sum): only a per-bag dot <dy_b, out_b> is needed besides
                # the per-entry dot <dy_b, e_j>.
                dy_dot_out = tf.reduce_sum(dy_pad * acc, axis=1)  # [B + 1]
                if combiner == "sqrtn":
                    raw_c = chunked(raw_weights, tf.constant(0, acc_dtype))

            def sum_grad_step(k, grad_acc, *weight_grads):
                dy_rows = tf.gather(dy_pad, bags_c[k])  # [chunk, D]
                contrib = dy_rows * weights_c[k][:, None]
                grad_acc = grad_acc + tf.math.unsorted_segment_sum(
                    contrib, targets_c[k], num_targets
                )
                if not weights_wanted:
                    return (grad_acc,)
                dot = tf.reduce_sum(rows_of(k) * dy_rows, axis=1)  # [chunk]
                if combiner in ("mean", "sqrtn"):
                    bag_scale = tf.gather(scale, bags_c[k])
                    bag_dot_out = tf.gather(dy_dot_out, bags_c[k])
                    if combiner == "sqrtn":
                        bag_dot_out = raw_c[k] * bag_scale * bag_dot_out
                    dot = (dot - bag_dot_out) * bag_scale
                    # Zero for a bag of scale 0, whatever its rows hold (0 * Inf).
                    dot = tf.where(tf.equal(bag_scale, 0), tf.zeros_like(dot), dot)
                dot = tf.where(tf.equal(bags_c[k], dummy), tf.zeros_like(dot), dot)
                # Row k of the [stored_chunks, chunk] buffer (no TensorArray: under XLA on
                # GPUs its concat came back with the wrong length for half types).
                return grad_acc, tf.tensor_scatter_nd_update(
                    weight_grads[0], tf.reshape(k, [1, 1]), tf.cast(dot, dtype)[None, :]
                )

            state = (tf.zeros(grad_shape, acc_dtype),)
            if weights_wanted:
                state += (tf.zeros(chunked_shape, dtype),)
            results = loop(sum_grad_step, state)
            grad_acc = results[0]
            weights_grad = tf.reshape(results[1], [-1])[:nnz] if weights_wanted else None

        if sparse_params_grad:
            params_grad = tf.IndexedSlices(
                tf.cast(grad_acc[:-1], dtype), tf.cast(unique_ids, ids_dtype), params_shape
            )
        else:
            params_grad = tf.cast(grad_acc, dtype)
        return params_grad, weights_grad

    output = tf.cast(acc[:-1], dtype)
    return output, backward


def composite_with_gradient(
    params: tf.Tensor,
    bags: _bags.Bags,
    combiner: str,
    padding_id: int | None,
    dense_grad: bool,
    xla: bool,
) -> tf.Tensor:
    if bags.weights is None:

        @tf.custom_gradient
        def forward(params):
            output, backward = composite(params, bags, combiner, padding_id, dense_grad, xla)
            return output, lambda dy: backward(dy, False)[0]

        return forward(params)

    @tf.custom_gradient
    def forward_weighted(params, weights):
        output, backward = composite(
            params, bags._replace(weights=weights), combiner, padding_id, dense_grad, xla
        )
        return output, lambda dy: backward(dy, True)

    return forward_weighted(params, bags.weights)
