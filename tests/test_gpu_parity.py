"""The GPU kernels against the CPU kernels, through TensorFlow: the same error text for
every bad input of every gather_reduce_sum op, the same sparse update, and bitwise
repeatable results under `tf.config.experimental.enable_op_determinism()`.

(Each op's numbers against the float64 references are checked by the other test files,
which run on the GPU when TensorFlow sees one; the TT ops' error parity is in
test_tt_ops.py.) Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from bags import RTOL
from processes import built_with_cuda, our_message, run_fresh_python

import tf_ttemb
from tf_ttemb.ops import _loader
from tf_ttemb.ops.sparse_apply import gather_reduce_sum_sparse_apply

pytestmark = pytest.mark.gpu

DEVICES = ("/CPU:0", "/GPU:0")
NUM_ROWS, DIM = 6, 3

# (ids, row_splits, padding_id or None): each breaks one rule of the ops' contract.
BAD_INPUTS = {
    "id_too_large": ([0, 7, 2, 1], [0, 2, 4], None),
    "negative_id": ([0, 1, -2, 1], [0, 2, 4], None),
    "id_not_padding": ([0, -3, 9, 1], [0, 2, 4], -3),
    "splits_start": ([0, 1, 2, 3], [1, 2, 4], None),
    "splits_order": ([0, 1, 2, 3], [0, 3, 2, 4], None),
    "splits_end": ([0, 1, 2, 3], [0, 1, 3], None),
}


@pytest.fixture(autouse=True)
def _needs_cuda_build():
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")


def _attrs(combiner, weighted, padding_id):
    return dict(
        combiner=combiner,
        has_weights=weighted,
        padding_id=-1 if padding_id is None else padding_id,
        has_padding_id=padding_id is not None,
    )


def _op_calls(lib, combiner, weighted):
    """name -> fn(device tensors) calling one op of the family on the bad input."""

    def checked(outputs, a):  # the forward and the check of its report, as the wrapper runs them
        lib.tf_ttemb_check_bag_report(
            outputs[2], padding_id=a["padding_id"], has_padding_id=a["has_padding_id"]
        )
        return outputs[:2]

    def forward(t, a):
        return checked(lib.tf_ttemb_gather_reduce_sum(t.params, t.ids, t.splits, t.weights, **a), a)

    def resource_forward(t, a):
        return checked(
            lib.tf_ttemb_resource_gather_reduce_sum(
                t.table.handle, t.ids, t.splits, t.weights, **a
            ),
            a,
        )

    def grad(t, a):
        return lib.tf_ttemb_gather_reduce_sum_grad(
            t.grad, t.ids, t.splits, t.weights, t.argmax, NUM_ROWS, **a
        )

    def dense_grad(t, a):
        return lib.tf_ttemb_gather_reduce_sum_dense_grad(
            t.grad, t.ids, t.splits, t.weights, t.argmax, NUM_ROWS, **a
        )

    def reads_output(op, resource=False, **extra):
        """An op of inputs (grad, table, ids, splits, weights, output): the table is params,
        or with `resource` the variable's handle."""

        def call(t, a):
            table = t.table.handle if resource else t.params
            return op(t.grad, table, t.ids, t.splits, t.weights, t.output, **extra, **a)

        return call

    def sparse_apply(optimizer):
        def call(t, a):
            return lib.tf_ttemb_gather_reduce_sum_sparse_apply(
                grad=t.grad,
                params=t.table.handle,
                indices=t.ids,
                row_splits=t.splits,
                weights=t.weights,
                output=t.output,
                argmax=t.argmax,
                learning_rate=tf.constant(0.1),
                epsilon=tf.constant(1e-3),
                accumulators=[] if optimizer == "sgd" else [t.accumulators[optimizer].handle],
                optimizer=optimizer,
                **a,
            )

        return call

    calls = {
        "forward": forward,
        "resource_forward": resource_forward,
        "grad": grad,
        "dense_grad": dense_grad,
    }
    if weighted:
        fused = lib.tf_ttemb_gather_reduce_sum_fused_grad
        calls.update(
            weights_grad=reads_output(lib.tf_ttemb_gather_reduce_sum_weights_grad),
            resource_weights_grad=reads_output(
                lib.tf_ttemb_resource_gather_reduce_sum_weights_grad, resource=True
            ),
            fused_grad=reads_output(fused, dense_grad=False),
            fused_dense_grad=reads_output(fused, dense_grad=True),
            resource_fused_grad=reads_output(
                lib.tf_ttemb_resource_gather_reduce_sum_fused_grad, resource=True
            ),
        )
    for optimizer in ("sgd", "rowwise_adagrad", "adagrad"):
        calls[f"sparse_apply_{optimizer}"] = sparse_apply(optimizer)
    return calls


class _Inputs:
    """Every input an op of the family takes, on one device, for one bad case."""

    def __init__(self, rng_seed, ids, splits, combiner, weighted):
        rng = np.random.default_rng(rng_seed)
        num_bags, nnz = len(splits) - 1, len(ids)
        self.params = tf.constant(rng.standard_normal((NUM_ROWS, DIM)), tf.float32)
        self.table = tf.Variable(self.params)
        self.accumulators = {
            "rowwise_adagrad": tf.Variable(tf.zeros([NUM_ROWS])),
            "adagrad": tf.Variable(tf.zeros([NUM_ROWS, DIM])),
        }
        self.ids = tf.constant(ids, tf.int64)
        self.splits = tf.constant(splits, tf.int64)
        self.weights = (
            tf.constant(rng.random(nnz), tf.float32) if weighted else tf.zeros([0], tf.float32)
        )
        self.grad = tf.constant(rng.standard_normal((num_bags, DIM)), tf.float32)
        self.output = tf.constant(rng.standard_normal((num_bags, DIM)), tf.float32)
        rows = num_bags if combiner == "max" else 0
        self.argmax = tf.zeros([rows, DIM], tf.int32)


@pytest.mark.parametrize(
    "combiner,weighted",
    [("sum", True), ("mean", False), ("max", False)],
    ids=["sum_weighted", "mean", "max"],
)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_errors_match_cpu_op_by_op(combiner, weighted, case):
    ids, splits, padding_id = BAD_INPUTS[case]
    lib = _loader.load_op_library()
    attrs = _attrs(combiner, weighted, padding_id)
    for name, call in _op_calls(lib, combiner, weighted).items():
        messages = {}
        for device in DEVICES:
            with tf.device(device):
                t = _Inputs(7, ids, splits, combiner, weighted)
                before = t.table.numpy()
                with pytest.raises(tf.errors.InvalidArgumentError) as info:
                    out = call(t, attrs)
                    tf.nest.map_structure(lambda x: x.numpy(), out)
                messages[device] = our_message(info.value.message)
                if name.startswith("sparse_apply"):
                    # The error comes before any row is written.
                    np.testing.assert_array_equal(t.table.numpy(), before, err_msg=name)
                    if t.table.device:
                        assert device[1:4] in t.table.device, (device, t.table.device)
        assert messages["/GPU:0"] == messages["/CPU:0"], (name, messages)
        assert ("indices[" in messages["/CPU:0"]) == ("id" in case), (name, messages)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("check_device", DEVICES)
def test_gpu_forward_reports_instead_of_waiting(case, check_device):
    """The GPU forward returns on bad input, its output from the valid entries only (no
    read out of bounds), and its report raises the CPU op's message wherever the check
    runs: on the GPU from the stream, or on the CPU from a copy of the report."""
    ids, splits, padding_id = BAD_INPUTS[case]
    lib = _loader.load_op_library()
    attrs = _attrs("sum", True, padding_id)
    with tf.device("/CPU:0"):
        t = _Inputs(7, ids, splits, "sum", True)
        with pytest.raises(tf.errors.InvalidArgumentError) as cpu_info:
            lib.tf_ttemb_gather_reduce_sum(t.params, t.ids, t.splits, t.weights, **attrs)
    with tf.device("/GPU:0"):
        t = _Inputs(7, ids, splits, "sum", True)
        output, _, report = lib.tf_ttemb_gather_reduce_sum(
            t.params, t.ids, t.splits, t.weights, **attrs
        )
    assert report.shape == [11] and "GPU" in report.device, (report.shape, report.device)
    if "id" in case:  # well-formed bags: each sums its entries with a valid id
        params, w = t.params.numpy().astype(np.float64), t.weights.numpy().astype(np.float64)
        want = np.zeros((len(splits) - 1, DIM))
        for b in range(len(splits) - 1):
            for j in range(splits[b], splits[b + 1]):
                if 0 <= ids[j] < NUM_ROWS:
                    want[b] += w[j] * params[ids[j]]
        np.testing.assert_allclose(output.numpy(), want, rtol=1e-6, atol=1e-6)
    with tf.device(check_device):
        with pytest.raises(tf.errors.InvalidArgumentError) as gpu_info:
            lib.tf_ttemb_check_bag_report(
                report, padding_id=attrs["padding_id"], has_padding_id=attrs["has_padding_id"]
            )
    assert our_message(gpu_info.value.message) == our_message(cpu_info.value.message)


@pytest.mark.parametrize("graph_kind", ["tf_function", "tf1_session"])
def test_gpu_wrapper_raises_bad_ids_from_the_report(graph_kind):
    """Through the wrapper on the GPU, a bad id fails the call whose output is fetched:
    a tf.function runs the report's check beside the lookup, a TF1 session because the
    output waits for it there."""
    table_values = np.arange(NUM_ROWS * DIM, dtype=np.float32).reshape(NUM_ROWS, DIM)
    ids_values = np.array([[1, NUM_ROWS + 2], [0, 3]], np.int64)
    message = rf"indices\[1\] = {NUM_ROWS + 2} is not in \[0, {NUM_ROWS}\)"
    if graph_kind == "tf_function":
        with tf.device("/GPU:0"):
            table = tf.Variable(table_values)
            lookup = tf.function(lambda ids: tf_ttemb.gather_reduce_sum(table, ids))
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                lookup(tf.constant(ids_values)).numpy()
        return
    graph = tf.Graph()
    with graph.as_default(), tf.device("/GPU:0"):
        table = tf.Variable(table_values)
        output = tf_ttemb.gather_reduce_sum(table, tf.constant(ids_values))
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(table.initializer)
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                session.run(output)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
@pytest.mark.parametrize(
    "combiner,weighted",
    [("sum", True), ("sqrtn", True), ("max", False)],
    ids=["sum_weighted", "sqrtn_weighted", "max"],
)
@pytest.mark.parametrize(
    "dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64], ids=lambda d: d.name
)
# The GPU's reduce-and-update paths: odd D (unaligned columns), narrow rows (several rows
# per warp), one aligned column chunk (the run kernel) and rows of several chunks (where
# row-wise Adagrad reduces to a temporary first); every case has one id in more than 256
# entries (a segment split into pieces).
@pytest.mark.parametrize("dim", [37, 8, 128, 1024])
def test_sparse_apply_gpu_matches_cpu(rng, dtype, combiner, weighted, optimizer, dim):
    num_rows, num_bags = 40, 25
    lengths = rng.integers(0, 30, size=num_bags)
    lengths[3] = 0  # an empty bag
    lengths[0] = 300
    flat = rng.integers(0, num_rows, size=int(lengths.sum()))
    flat[:300] = 7  # a hot id
    flat[rng.random(flat.size) < 0.1] = 5  # padding
    table0 = rng.standard_normal((num_rows, dim))
    if combiner == "max":  # distinct values: no ties whose winner depends on rounding
        table0 = rng.permutation(num_rows * dim).reshape(num_rows, dim) / (num_rows * dim)
    weights0 = rng.random(flat.size)
    upstream0 = rng.standard_normal((num_bags, dim))
    acc_dtype = tf.float64 if dtype == tf.float64 else tf.float32
    acc_shape = (num_rows,) if optimizer == "rowwise_adagrad" else (num_rows, dim)
    acc0 = rng.uniform(0.1, 1.0, size=acc_shape)
    results = {}
    for device in DEVICES:
        with tf.device(device):
            table = tf.Variable(tf.cast(table0, dtype))
            accumulator = None if optimizer == "sgd" else tf.Variable(tf.cast(acc0, acc_dtype))
            trigger = tf.Variable(tf.zeros([0]))
            ids = tf.RaggedTensor.from_row_lengths(tf.constant(flat, tf.int64), lengths)
            weights = tf.RaggedTensor.from_row_lengths(tf.cast(weights0, dtype), lengths)
            with tf.GradientTape() as tape:
                tape.watch(weights.flat_values)
                out = gather_reduce_sum_sparse_apply(
                    table,
                    ids,
                    weights if weighted else None,
                    trigger=trigger,
                    optimizer=optimizer,
                    learning_rate=0.2,
                    accumulator=accumulator,
                    epsilon=1e-3,
                    combiner=combiner,
                    padding_id=5,
                )
            dw = tape.gradient(out, weights.flat_values, output_gradients=tf.cast(upstream0, dtype))
            assert device[1:4] in table.device, table.device
            results[device] = [
                tf.cast(x, tf.float64).numpy()
                for x in [out, table]
                + ([accumulator] if accumulator is not None else [])
                + ([dw] if weighted else [])
            ]
    rtol = RTOL[dtype]
    for name, got, want in zip(
        ["output", "table", "accumulator or dw", "dw"], results["/GPU:0"], results["/CPU:0"]
    ):
        np.testing.assert_allclose(
            got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=name
        )


DETERMINISM_SCRIPT = """
    import json
    import numpy as np
    import keras
    import tensorflow as tf
    tf.config.experimental.enable_op_determinism()
    import tf_ttemb
    from tf_ttemb.layers import (EmbeddingBag, ProductKeyMemory, TTEmbeddingBag,
                                 TableBatchedTTEmbeddingBag)

    def layers():
        return {
            "embedding_bag": EmbeddingBag(500, 24, combiner="mean"),
            "embedding_bag_dense_grad": EmbeddingBag(500, 24, dense_grad=True),
            "tt": TTEmbeddingBag(500, 24, tt_ranks=[8, 8], tt_p_shapes=[8, 8, 8],
                                 tt_q_shapes=[2, 3, 4]),
            "tt_fused_sgd": TTEmbeddingBag(500, 24, tt_ranks=[8, 8], tt_p_shapes=[8, 8, 8],
                                           tt_q_shapes=[2, 3, 4], sparse=True,
                                           optimizer="sgd", learning_rate=0.1),
            "tt_batched": TableBatchedTTEmbeddingBag(2, 500, 24, tt_ranks=[8, 8],
                                                     tt_p_shapes=[8, 8, 8],
                                                     tt_q_shapes=[2, 3, 4]),
            "pkm_fused": ProductKeyMemory(16, n_keys=32, k_dim=16, heads=2, knn=8,
                                          values_optimizer="rowwise_adagrad"),
        }

    def inputs(name, rng):
        if name.startswith("pkm"):
            return tf.constant(rng.standard_normal((4, 9, 12)), tf.float32), None
        shape = (2, 64, 20) if name == "tt_batched" else (64, 20)
        ids = tf.constant(rng.zipf(1.2, size=shape) % 500, tf.int64)
        weights = tf.constant(rng.random(shape), tf.float32)
        return ids, (None if name.startswith("tt") else weights)

    def train(name):
        keras.utils.set_random_seed(3)
        layer = layers()[name]
        rng = np.random.default_rng(11)
        with tf.device("/GPU:0"):
            for step in range(3):
                x, w = inputs(name, rng)
                kwargs = {} if name.startswith("embedding") else {"training": True}
                with tf.GradientTape() as tape:
                    y = layer(x, **kwargs) if w is None else layer(x, w, **kwargs)
                    loss = tf.reduce_sum(tf.sin(3.0 * y))
                grads = tape.gradient(loss, layer.trainable_variables)
                for v, g in zip(layer.trainable_variables, grads):
                    if g is not None and v.shape.num_elements():
                        v.assign_sub(0.05 * tf.convert_to_tensor(g))
        return ([np.asarray(v.numpy()) for v in layer.weights],
                [getattr(v, "value", v).device for v in layer.weights])

    report = {}
    for name in layers():
        first, devices = train(name)
        second, _ = train(name)
        report[name] = {
            "equal": all(np.array_equal(a, b, equal_nan=True) for a, b in zip(first, second)),
            "on_gpu": all("GPU" in d for d in devices if d),
        }
    print(json.dumps(report))
"""


def test_every_layer_is_bitwise_repeatable_under_op_determinism():
    import json

    report = json.loads(run_fresh_python(DETERMINISM_SCRIPT, timeout=600))
    for name, result in report.items():
        assert result["equal"], (name, report)
        assert result["on_gpu"], (name, report)
