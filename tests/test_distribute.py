"""tf.distribute: MirroredStrategy for every layer (and the grouped layer's fused update
under it), and the sharded lookups (EmbeddingBag, GroupedEmbeddingBag) without a cluster.
test_distribute_parameter_server.py has ParameterServerStrategy on a localhost cluster.

Strategies reconfigure TensorFlow's runtime for the whole process (logical devices,
cluster connections), so each scenario runs in a fresh Python subprocess that prints one
JSON report per line; the tests here check the reports.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tf_ttemb
from tf_ttemb import distribute

REPO_ROOT = pathlib.Path(tf_ttemb.__file__).resolve().parent.parent
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def run_script(script: str, *args: str, timeout: int = 300) -> list[dict]:
    """Runs `script` in a fresh interpreter; returns the JSON objects it printed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO_ROOT,
    )
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0, (
        f"subprocess failed (rc {result.returncode}); reports {reports}\n{result.stderr[-6000:]}"
    )
    return reports


# --------------------------------------------------------------------------------------
# MirroredStrategy over two replicas: two logical CPU devices; two GPUs (NCCL all-reduce)
# where two are visible; one GPU split into two logical GPUs where only one is.
# --------------------------------------------------------------------------------------

# The two replicas' devices (`devices`) and cross-device ops (`cross`) of argv[2]'s kind.
TWO_REPLICAS = """
    import json, sys
    import numpy as np
    import tensorflow as tf

    tf.config.experimental.enable_tensor_float_32_execution(False)  # vs. float64 math
    kind = sys.argv[2]
    if kind == "cpu":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        devices, cross = ["/cpu:0", "/cpu:1"], None
    elif kind == "two_gpus":
        devices, cross = ["/gpu:0", "/gpu:1"], tf.distribute.NcclAllReduce()
    else:  # one GPU as two logical GPUs (NCCL needs distinct GPUs)
        gpu = tf.config.list_physical_devices("GPU")[0]
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=4096)] * 2)
        devices = ["/gpu:0", "/gpu:1"]
        cross = tf.distribute.ReductionToOneDevice("/gpu:0")
"""

MIRRORED = (
    TWO_REPLICAS
    + """
    import keras
    import tf_ttemb
    from tf_ttemb.layers import (EmbeddingBag, GroupedEmbeddingBag, ProductKeyMemory,
                                 TTEmbeddingBag)
    from tf_ttemb.optimizers import LazyAdam, RowWiseAdagrad

    mirrored = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross)
    single = tf.distribute.OneDeviceStrategy(devices[0])
    assert mirrored.num_replicas_in_sync == 2
    B, STEPS = 6, 2  # global batch (3 examples per replica), steps per fit
    rng = np.random.default_rng(int(sys.argv[1]))
    data = {
        "bag": rng.integers(0, 30, size=(B * STEPS, 3)),  # rows 30..36 never used
        "tt": rng.integers(0, 48, size=(B * STEPS, 4)),
        "x": rng.normal(size=(B * STEPS, 5)),
        "g1": rng.integers(0, 20, size=(B * STEPS, 2)),
        "g2": rng.integers(0, 9, size=(B * STEPS, 1)),
    }
    target = rng.normal(size=(B * STEPS, 1))

    def build(strategy, dtype, fused):
        with strategy.scope():
            keras.utils.set_random_seed(11)
            bag = keras.Input((3,), dtype="int64", name="bag")
            tt_ids = keras.Input((4,), dtype="int64", name="tt")
            x = keras.Input((5,), dtype=dtype, name="x")
            g1 = keras.Input((2,), dtype="int64", name="g1")
            g2 = keras.Input((1,), dtype="int64", name="g2")
            features = keras.layers.Concatenate(dtype=dtype)([
                EmbeddingBag(37, 4, combiner="sqrtn" if fused else "mean", dtype=dtype,
                             name="eb")(bag),
                # sparse=True: the cores are updated inside the backward pass (fused SGD).
                TTEmbeddingBag(48, 8, tt_ranks=3, seed=3, sparse=fused, learning_rate=0.2,
                               dtype=dtype, name="tt_bag")(tt_ids),
                ProductKeyMemory(4, n_keys=6, k_dim=4, heads=2, knn=3, query_batchnorm=False,
                                 dtype=dtype, name="pkm")(x),
                GroupedEmbeddingBag(
                    [{"name": "g1", "input_dim": 20, "output_dim": 3},
                     {"name": "g2", "input_dim": 9, "output_dim": 3, "combiner": "mean"}],
                    dtype=dtype, name="grp")({"g1": g1, "g2": g2}),
            ])
            out = keras.layers.Dense(1, dtype=dtype, name="head")(features)
            return keras.Model([bag, tt_ids, x, g1, g2], out)

    def train(strategy, dtype, opt_name, fused, initial):
        model = build(strategy, dtype, fused)
        model.set_weights(initial)
        with strategy.scope():
            opt = {"lazy_adam": lambda: LazyAdam(0.05),
                   "rowwise_adagrad": lambda: RowWiseAdagrad(0.2),
                   "sgd": lambda: keras.optimizers.SGD(0.3)}[opt_name]()
            model.compile(optimizer=opt, loss="mse")
        inputs = {k: (v.astype(dtype) if k == "x" else v) for k, v in data.items()}
        model.fit(inputs, target.astype(dtype), batch_size=B, epochs=1, shuffle=False,
                  verbose=0)
        # Read on the strategy's first device, with how far the other copies are from it.
        out = []
        for w in model.weights:
            copies = [np.asarray(c) for c in strategy.experimental_local_results(w.value)]
            spread = max(float(np.max(np.abs(c - copies[0]), initial=0.0)) for c in copies)
            out.append((w.path, copies[0], spread))
        return out

    for dtype, opt_name, fused in (("float32", "sgd", False), ("float64", "lazy_adam", True),
                                   ("float64", "rowwise_adagrad", False)):
        initial = build(single, dtype, fused).get_weights()
        one = train(single, dtype, opt_name, fused, initial)
        two = train(mirrored, dtype, opt_name, fused, initial)
        rows = {}
        for (path, ref, _), (path2, got, spread), start in zip(one, two, initial):
            assert path == path2, (path, path2)
            scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
            rows[path] = {
                "error": float(np.max(np.abs(got - ref))) / scale if ref.size else 0.0,
                "copies_differ": spread / scale,
                "moved": float(np.max(np.abs(ref - start))) if ref.size else None,
            }
            if path == "eb/embeddings":
                rows[path]["unused_rows_same"] = bool(
                    np.array_equal(got[30:], start[30:]) and np.array_equal(ref[30:], start[30:]))
        print(json.dumps({"case": f"fit/{dtype}/{opt_name}/{'fused' if fused else 'plain'}",
                          "dtype": dtype, "weights": rows}), flush=True)

    # A custom loop on gather_reduce_sum itself: every combiner (one table each), weights,
    # padding, an empty bag; replica gradients are summed by the optimizer.
    COMBINERS = ("sum", "mean", "sqrtn", "max")

    def loop(strategy, tables0, ids, weights, dy, traced):
        with strategy.scope():
            tables = [tf.Variable(t, name=f"table_{c}") for t, c in zip(tables0, COMBINERS)]
            opt = keras.optimizers.SGD(0.5)
            opt.build(tables)
        share = B // strategy.num_replicas_in_sync

        def replica_step(ids, weights, dy):
            with tf.GradientTape() as tape:
                loss = 0.0
                for table, combiner in zip(tables, COMBINERS):
                    out = tf_ttemb.gather_reduce_sum(
                        table, ids, None if combiner == "max" else weights,
                        combiner=combiner, padding_id=0)
                    loss += tf.reduce_sum(out * dy)
            traced.update(op.type for op in tf.compat.v1.get_default_graph().get_operations())
            grads = tape.gradient(loss, tables)
            traced.update("grad:" + type(g).__name__ for g in grads)
            opt.apply(grads, tables)

        @tf.function
        def step(*args):
            strategy.run(replica_step, args)

        def local(array):
            return strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(array[ctx.replica_id_in_sync_group * share:
                                              (ctx.replica_id_in_sync_group + 1) * share]))
        step(local(ids), local(weights), local(dy))
        return [t.numpy() for t in tables]

    tables0 = [rng.normal(size=(23, 5)) for _ in COMBINERS]
    ids = rng.integers(0, 20, size=(B, 4))
    ids[1] = 0  # an empty bag (all padding)
    weights = rng.uniform(0.5, 2.0, size=(B, 4))
    dy = rng.normal(size=(B, 5))
    traced = set()
    two = loop(mirrored, tables0, ids, weights, dy, traced)
    one = loop(single, tables0, ids, weights, dy, set())
    for combiner, a, b, start in zip(COMBINERS, two, one, tables0):
        print(json.dumps({
            "case": f"loop/{combiner}", "dtype": "float64",
            "error": float(np.max(np.abs(a - b))),
            "moved": float(np.max(np.abs(b - start))),
            "unused_rows_same": bool(np.array_equal(a[20:], start[20:])),
            "custom_op": "TfTtemb>ResourceGatherReduceSum" in traced,
            "composite": "While" in traced or "StatelessWhile" in traced,
            "grads": sorted(t for t in traced if t.startswith("grad:")),
        }), flush=True)
"""
)


PKM_MOVING_STATS = """
    import json, sys
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    from tf_ttemb.layers import ProductKeyMemory

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(int(sys.argv[1]))
    x = rng.normal(size=(8, 5)).astype("float32")
    with strategy.scope():
        layer = ProductKeyMemory(4, n_keys=6, k_dim=4, heads=2, knn=3)
        layer.build((None, 5))
    halves = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(x[4 * ctx.replica_id_in_sync_group:
                                  4 * (ctx.replica_id_in_sync_group + 1)]))
    tf.function(lambda v: strategy.run(lambda xs: layer(xs, training=True), (v,)))(halves)
    rows = {}
    for var, half_stat in ((layer.query_bn_moving_mean, "mean"),
                           (layer.query_bn_moving_variance, "var")):
        copies = [c.numpy() for c in strategy.experimental_local_results(var.value)]
        rows[half_stat] = {"copies_differ": float(np.max(np.abs(copies[0] - copies[1]))),
                           "value": copies[0].tolist()}
    # The expected moving statistics: each replica's update from its half, averaged.
    q = (x @ layer.query_kernel.numpy() + layer.query_bias.numpy()).astype(np.float64)
    expect_mean, expect_var = [], []
    for part in (q[:4], q[4:]):
        expect_mean.append(0.9 * 0.0 + 0.1 * part.mean(0))
        expect_var.append(0.9 * 1.0 + 0.1 * part.var(0, ddof=1))
    rows["mean"]["expected"] = np.mean(expect_mean, 0).tolist()
    rows["var"]["expected"] = np.mean(expect_var, 0).tolist()
    print(json.dumps(rows), flush=True)
"""


def test_mirrored_pkm_moving_statistics_stay_in_sync(rng):
    """Replicas' batch-norm updates are averaged into every copy (aggregation="mean")."""
    (report,) = run_script(PKM_MOVING_STATS, str(int(rng.integers(1 << 30))))
    for stat in ("mean", "var"):
        assert report[stat]["copies_differ"] == 0.0, report
        np.testing.assert_allclose(
            report[stat]["value"], report[stat]["expected"], rtol=1e-5, atol=1e-6
        )


def _replica_kinds() -> list:
    """Where the two replicas run: always two logical CPUs; two GPUs (NCCL) where two are
    visible, else one GPU split in two where one is."""
    gpus = len(tf.config.list_physical_devices("GPU"))
    return ["cpu"] + (["two_gpus"] if gpus >= 2 else ["one_gpu_split"] if gpus == 1 else [])


@pytest.mark.parametrize("kind", _replica_kinds())
def test_mirrored_strategy_matches_one_device(rng, kind):
    """Two replicas train EmbeddingBag, TTEmbeddingBag, ProductKeyMemory and
    GroupedEmbeddingBag (implementation
    "auto": the custom ops, reading each replica's copy in place) to the weights a single
    device reaches, with SGD (float32), LazyAdam plus TTEmbeddingBag's fused sparse update
    (float64) and RowWiseAdagrad (float64); every replica's copy of every weight is the
    same; gather_reduce_sum's gradients for every combiner in a custom loop."""
    reports = run_script(MIRRORED, str(int(rng.integers(1 << 30))), kind)
    cases = {report["case"]: report for report in reports}
    assert sorted(cases) == [
        "fit/float32/sgd/plain",
        "fit/float64/lazy_adam/fused",
        "fit/float64/rowwise_adagrad/plain",
        "loop/max",
        "loop/mean",
        "loop/sqrtn",
        "loop/sum",
    ], sorted(cases)
    for name, report in cases.items():
        tolerance = TOLERANCE[report["dtype"]]
        if name.startswith("fit/"):
            weights = report["weights"]
            assert {path.split("/")[0] for path in weights} == {
                "eb",
                "tt_bag",
                "pkm",
                "grp",
                "head",
            }
            for path, row in weights.items():
                assert row["error"] <= tolerance, (name, path, row)
                # The replicas' copies agree: bitwise on CPUs; on GPUs TensorFlow's
                # scatter of the gathered (not deduplicated) IndexedSlices adds the
                # replicas' rows for one id in no fixed order, so within rounding.
                assert row["copies_differ"] <= (0.0 if kind == "cpu" else tolerance), (
                    name,
                    path,
                    row,
                )
                # Every weight moved (bar the empty variable through which TTEmbeddingBag's
                # fused update is reached), so equality is not that of untrained models.
                assert row["moved"] is None or row["moved"] > 1e-4, (name, path, row)
            assert weights["eb/embeddings"]["unused_rows_same"], name
        else:
            assert report["error"] <= tolerance, report
            assert report["moved"] > 1e-3, report
            assert report["unused_rows_same"], report
            assert report["custom_op"] and not report["composite"], report
            assert report["grads"] == ["grad:IndexedSlices"], report


# GroupedEmbeddingBag(sparse=True) under MirroredStrategy: the fused update of every
# replica's bags applied once to each replica's copy.
MIRRORED_GROUPED_FUSED = (
    TWO_REPLICAS
    + """
    import keras
    from tf_ttemb.layers import GroupedEmbeddingBag

    mirrored = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross)
    single = tf.distribute.OneDeviceStrategy(devices[0])
    B, STEPS = 8, 3  # global batch (4 examples per replica), steps
    FEATURES = [
        {"name": "user", "input_dim": 20, "output_dim": 4},
        {"name": "item", "input_dim": 15, "output_dim": 4, "combiner": "mean",
         "padding_id": 0},
        {"name": "history", "input_dim": 15, "output_dim": 4, "combiner": "mean",
         "padding_id": 0, "table": "item"},
        {"name": "tags", "input_dim": 11, "output_dim": 4, "combiner": "max"},
        {"name": "country", "input_dim": 7, "output_dim": 3, "combiner": "sqrtn"},
    ]
    DENSE = {"user": 1, "item": 3, "tags": 2, "country": 2}  # history is ragged
    CASES = json.loads(sys.argv[3])  # [how, dtype, optimizer]
    rng = np.random.default_rng(int(sys.argv[1]))
    data = {n: rng.integers(0, f["input_dim"], size=(B * STEPS, DENSE[n]))
            for n, f in ((f["name"], f) for f in FEATURES) if n in DENSE}
    data["item"][rng.random(data["item"].shape) < 0.25] = 0
    data["item"][1] = 0  # an empty bag (all padding)
    lengths = rng.integers(0, 5, size=B * STEPS)
    lengths[2] = 0
    history = rng.integers(0, 15, size=lengths.sum())
    history_splits = np.concatenate([[0], np.cumsum(lengths)])
    item_weights = rng.uniform(0.5, 2.0, size=data["item"].shape)
    country_weights = rng.uniform(0.5, 2.0, size=data["country"].shape)
    target = rng.normal(size=(B * STEPS, 1))
    dy = rng.normal(size=(B * STEPS, 19))

    def copies(variable, strategy):
        return [np.asarray(c) for c in strategy.experimental_local_results(variable.value)]

    def spread(variable, strategy):
        got = copies(variable, strategy)
        return max(float(np.max(np.abs(c - got[0]), initial=0.0)) for c in got)

    def build(strategy, dtype, optimizer):
        with strategy.scope():
            keras.utils.set_random_seed(5)
            inputs = {n: keras.Input((DENSE[n],), dtype="int64", name=n) for n in DENSE}
            w_item = keras.Input((3,), dtype=dtype, name="w_item")
            w_country = keras.Input((2,), dtype=dtype, name="w_country")
            layer = GroupedEmbeddingBag(
                [f for f in FEATURES if f["name"] in DENSE], sparse=True, optimizer=optimizer,
                learning_rate=0.3, eps=0.1, dtype=dtype, name="grp")
            out = layer(inputs, {"item": w_item, "country": w_country})
            head = keras.layers.Dense(1, dtype=dtype, name="head")(out)
            model = keras.Model({**inputs, "w_item": w_item, "w_country": w_country}, head)
            model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
        return model

    def fit(strategy, dtype, optimizer, initial):
        # Model.fit over dense ids: every weight after the steps (first copy) and how far
        # the replicas' copies are apart.
        model = build(strategy, dtype, optimizer)
        model.set_weights(initial)
        x = {n: data[n] for n in DENSE}
        x.update(w_item=item_weights.astype(dtype), w_country=country_weights.astype(dtype))
        model.fit(x, target.astype(dtype), batch_size=B, epochs=1, shuffle=False, verbose=0)
        return ([copies(w, strategy)[0] for w in model.weights],
                max(spread(w, strategy) for w in model.weights))

    def loop(strategy, dtype, optimizer, start):
        # strategy.run over every feature (ragged history, weights), loss sum(out * dy),
        # the trigger's gradient applied by a Keras optimizer: the stacks after the steps.
        with strategy.scope():
            layer = GroupedEmbeddingBag(FEATURES, sparse=True, optimizer=optimizer,
                                        learning_rate=0.3, eps=0.1, dtype=dtype)
            layer.build()
            for w, v in layer.stacked.items():
                v.assign(start[w].astype(dtype))
            opt = keras.optimizers.SGD(1.0)
            opt.build(layer.trainable_variables)
        share = B // strategy.num_replicas_in_sync

        def replica_step(ids, splits, flat, w_item, w_country, dy):
            inputs = dict(ids, history=tf.RaggedTensor.from_row_splits(flat, splits))
            with tf.GradientTape() as tape:
                out = layer(inputs, {"item": w_item, "country": w_country}, training=True)
                loss = tf.reduce_sum(out * dy)
            grads = tape.gradient(loss, layer.trainable_variables)
            opt.apply(grads, layer.trainable_variables)

        @tf.function(reduce_retracing=True)  # the ragged feature's length varies
        def step(*args):
            strategy.run(replica_step, args)

        def local(array, s, offset=0):
            def part(ctx):
                lo = s * B + ctx.replica_id_in_sync_group * share
                return tf.constant(array[lo : lo + share])
            return strategy.experimental_distribute_values_from_function(part)

        def local_history(s):
            def part(ctx, what):
                lo = s * B + ctx.replica_id_in_sync_group * share
                first, last = history_splits[lo], history_splits[lo + share]
                if what == "splits":
                    return tf.constant(history_splits[lo : lo + share + 1] - first)
                return tf.constant(history[first:last])
            return [strategy.experimental_distribute_values_from_function(
                lambda ctx, what=what: part(ctx, what)) for what in ("splits", "flat")]

        for s in range(STEPS):
            ids = {n: local(data[n], s) for n in DENSE}
            step(ids, *local_history(s), local(item_weights.astype(dtype), s),
                 local(country_weights.astype(dtype), s), local(dy.astype(dtype), s))
        state = list(layer.stacked.values()) + list(layer.accumulators.values())
        return ([copies(v, strategy)[0] for v in state],
                max(spread(v, strategy) for v in state))

    for how, dtype, optimizer in CASES:
        if how == "loop":
            continue
        # Tables and head from a wider range than their initializers give (accumulators 0).
        initial = [rng.uniform(-1, 1, size=w.shape).astype(dtype)
                   if "embeddings" in w.path or "kernel" in w.path else w.numpy()
                   for w in build(single, dtype, optimizer).weights]
        one, _ = fit(single, dtype, optimizer, initial)
        two, copies_differ = fit(mirrored, dtype, optimizer, initial)
        errors = [float(np.max(np.abs(a - b), initial=0.0)) / max(1.0, float(np.max(np.abs(b))))
                  for a, b in zip(two, one) if b.size]
        moved = [float(np.max(np.abs(b - a))) for a, b in zip(initial, one) if b.size]
        print(json.dumps({"case": f"fit/{dtype}/{optimizer}", "dtype": dtype, "error": max(errors),
                          "copies_differ": copies_differ, "moved": min(moved)}), flush=True)
    for how, dtype, optimizer in CASES:
        if how == "fit":
            continue
        start = {4: rng.uniform(-1, 1, size=(46, 4)), 3: rng.uniform(-1, 1, size=(7, 3))}
        one, _ = loop(single, dtype, optimizer, start)
        two, copies_differ = loop(mirrored, dtype, optimizer, start)
        errors = [float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b))))
                  for a, b in zip(two, one)]
        stacks_moved = min(float(np.max(np.abs(one[i] - start[w])))
                           for i, w in enumerate(start))
        # Rows of `user` (stack 4, rows 0-19) that no step read stay as they were.
        read = np.zeros(20, bool)
        read[data["user"].reshape(-1)] = True
        unread_same = bool(np.array_equal(two[0][:20][~read], start[4][:20][~read].astype(dtype)))
        print(json.dumps({"case": f"loop/{dtype}/{optimizer}", "dtype": dtype,
                          "error": max(errors), "copies_differ": copies_differ,
                          "moved": stacks_moved, "unread_same": unread_same}), flush=True)
"""
)


@pytest.mark.parametrize("kind", _replica_kinds())
def test_mirrored_grouped_fused_update_matches_one_device(rng, kind):
    """GroupedEmbeddingBag(sparse=True) on two replicas: Model.fit (SGD, row-wise Adagrad,
    Adagrad; dense ids, weights, padding, an empty bag, max) and a custom strategy.run loop
    (every feature, a ragged one with an empty bag, a shared table) reach the stacks,
    accumulators and head weights of one device over the whole batch, every replica's copy
    of a stack is the same, and rows no step read stay unchanged."""
    # Every optimizer, Model.fit and a custom loop (the runs are slow on two cores).
    runs = [
        ("fit", "float64", "adagrad"),
        ("fit", "float32", "rowwise_adagrad"),
        ("loop", "float64", "sgd"),
        ("loop", "float64", "rowwise_adagrad"),
    ]
    reports = run_script(
        MIRRORED_GROUPED_FUSED,
        str(int(rng.integers(1 << 30))),
        kind,
        json.dumps(runs),
        timeout=600,
    )
    cases = {report["case"]: report for report in reports}
    assert sorted(cases) == sorted("/".join(run) for run in runs), sorted(cases)
    for name, report in cases.items():
        tolerance = TOLERANCE[report["dtype"]]
        assert report["error"] <= tolerance, report
        # Every replica applies the same update, from the same gathered inputs: bitwise.
        assert report["copies_differ"] == 0.0, report
        assert report["moved"] > 1e-3, report
        if name.startswith("loop/"):
            assert report["unread_same"], report


def test_fused_grouped_refuses_other_strategies():
    """GroupedEmbeddingBag(sparse=True) names the strategy it cannot run under."""
    from tf_ttemb.layers import GroupedEmbeddingBag

    features = [{"name": "a", "input_dim": 4, "output_dim": 2}]
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with strategy.scope():
        with pytest.raises(
            ValueError,
            match=r"sparse=True\) supports the strategies MirroredStrategy and "
            r"OneDeviceStrategy only, got CentralStorageStrategy: every replica reads the one "
            r"copy of the table",
        ):
            GroupedEmbeddingBag(features, sparse=True)
        GroupedEmbeddingBag(features)  # sparse=False is fine
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        GroupedEmbeddingBag(features, sparse=True)


# --------------------------------------------------------------------------------------
# sharded_gather_reduce_sum on lists of shards (this process, no cluster).
# --------------------------------------------------------------------------------------

import bags as bag_data  # noqa: E402  (tests/ is on sys.path under pytest)


@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
@pytest.mark.parametrize("combiner_weighted", bag_data.COMBINER_WEIGHTING, ids=bag_data.combiner_id)
@pytest.mark.parametrize("dtype_name", ["float64", "float32", "float16", "bfloat16"])
def test_sharded_lookup_matches_reference(rng, form, combiner_weighted, dtype_name):
    """Three uneven shards: output, per-shard IndexedSlices gradients and weight gradients
    equal the float64 reference of the unsharded table (padding, empty bags included)."""
    combiner, weighted = combiner_weighted
    dtype = bag_data.DTYPES[dtype_name]
    num_rows, dim, padding_id = 23, 5, 4
    rows = [7, 11, 5]
    bags = bag_data.make_bags(rng, form, num_rows, tf.int64, padding_id=padding_id)
    params, params64 = bag_data.make_params(rng, num_rows, dim, dtype, distinct=True)
    offsets = np.cumsum([0] + rows)
    shards = [tf.Variable(params[lo:hi]) for lo, hi in zip(offsets[:-1], offsets[1:])]
    weights = weights64 = None
    if weighted:
        values, weights64 = bag_data.make_weights(rng, bags, dtype)
        weights = bag_data.weights_like(bags.ids, values)
    upstream, upstream64 = bag_data.make_upstream(rng, bags, dim, dtype)
    with tf.GradientTape() as tape:
        if weighted:
            tape.watch(values)
        out = distribute.sharded_gather_reduce_sum(
            shards, bags.ids, weights, combiner=combiner, padding_id=padding_id
        )
        loss = tf.reduce_sum(tf.cast(out, tf.float64) * tf.cast(upstream, tf.float64))
    grads = tape.gradient(loss, shards + ([values] if weighted else []))
    want, want_dp, want_dw = bag_data.reference_all(
        params64, bags, weights64, upstream64, combiner, padding_id
    )
    assert out.dtype == dtype and tuple(out.shape) == bags.lead_shape + (dim,)
    got = bag_data.dense_value(out).reshape(bags.num_bags, dim)
    bag_data.assert_close(got, want[0], want[1], dtype, "output")
    touched = set(np.unique(bags.flat_ids[bags.flat_ids != padding_id]).tolist())
    for s, (grad, lo, hi) in enumerate(zip(grads, offsets[:-1], offsets[1:])):
        assert isinstance(grad, tf.IndexedSlices), (s, type(grad))
        # Only this shard's touched rows, in local numbering.
        assert set(grad.indices.numpy().tolist()) <= {r - lo for r in touched if lo <= r < hi}
        assert int(grad.dense_shape[0]) == hi - lo
        bag_data.assert_close(
            bag_data.dense_value(grad), want_dp[0][lo:hi], want_dp[1][lo:hi], dtype, f"shard {s}"
        )
    if weighted:
        bag_data.assert_close(
            bags.csr_from_values(bag_data.dense_value(grads[-1])),
            want_dw[0],
            want_dw[1],
            dtype,
            "weights grad",
        )


def test_sharded_lookup_in_tf_function_and_errors(rng):
    table = rng.normal(size=(9, 3))
    shards = [tf.Variable(table[:5]), tf.Variable(table[5:])]
    ids = tf.constant([[1, 8, 8], [0, 6, 2]])
    lookup = tf.function(
        lambda ids: distribute.sharded_gather_reduce_sum(shards, ids, combiner="sqrtn")
    )
    want = (table[[1, 8, 8]].sum(0) / np.sqrt(3), table[[0, 6, 2]].sum(0) / np.sqrt(3))
    np.testing.assert_allclose(lookup(ids).numpy(), np.stack(want), rtol=1e-12)
    bad = r"indices\[3\] = 9 is not in \[0, 9\)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=bad):
        distribute.sharded_gather_reduce_sum(shards, tf.constant([[1, 2], [3, 9]]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"is not in \[0, 9\)"):
        lookup(tf.constant([[1, 2, -3], [3, 4, 5]]))
    with pytest.raises(ValueError, match=r"shard 1 is \(4, 2\) float64"):
        distribute.sharded_gather_reduce_sum(
            [tf.Variable(table[:5]), tf.Variable(table[5:, :2])], ids
        )
    with pytest.raises(ValueError, match="combiner 'max' does not take weights"):
        distribute.sharded_gather_reduce_sum(shards, ids, tf.ones([2, 3], tf.float64), "max")
    # Not sharded: the plain op.
    assert distribute.shards_of(tf.Variable(table)) is None
    np.testing.assert_allclose(
        distribute.sharded_gather_reduce_sum(tf.constant(table), ids).numpy(),
        np.stack([table[[1, 8, 8]].sum(0), table[[0, 6, 2]].sum(0)]),
        rtol=1e-12,
    )


@pytest.mark.parametrize("combiner_weighted", bag_data.COMBINER_WEIGHTING, ids=bag_data.combiner_id)
@pytest.mark.parametrize("dtype_name", ["float64", "float32", "float16", "bfloat16"])
def test_sharded_grouped_lookup_matches_reference(rng, combiner_weighted, dtype_name):
    """Three features (dense, ragged, sparse ids; two share a table) on a stacked table of
    18 rows in three shards that split both tables: output, per-shard IndexedSlices
    gradients and weight gradients equal the float64 reference of each feature's table."""
    combiner, weighted = combiner_weighted
    dtype = bag_data.DTYPES[dtype_name]
    dim, num_rows, row_offsets, padding_ids = 3, [7, 11, 7], [0, 7, 0], [None, 4, 2]
    rows = [5, 8, 5]  # boundaries at rows 5 (inside table 0) and 13 (inside table 1)
    forms = ["dense2d", "ragged", "sparse"]
    bags = [
        bag_data.make_bags(rng, form, n, tf.int64, padding_id=p)
        for form, n, p in zip(forms, num_rows, padding_ids)
    ]
    params, params64 = bag_data.make_params(rng, 18, dim, dtype, distinct=True)
    offsets = np.cumsum([0] + rows)
    shards = [tf.Variable(params[lo:hi]) for lo, hi in zip(offsets[:-1], offsets[1:])]
    values, weights, weights64 = [], None, [None] * 3
    if weighted:
        for t, b in enumerate(bags):
            v, weights64[t] = bag_data.make_weights(rng, b, dtype)
            values.append(v)
        weights = [bag_data.weights_like(b.ids, v) for b, v in zip(bags, values)]
    upstream, upstream64 = bag_data.quantize(rng.normal(size=(6, 3 * dim)), dtype)
    with tf.GradientTape() as tape:
        tape.watch(values)
        out = distribute.sharded_grouped_gather_reduce_sum(
            shards,
            [b.ids for b in bags],
            weights,
            num_rows=num_rows,
            row_offsets=row_offsets,
            combiner=combiner,
            padding_ids=padding_ids,
        )
        loss = tf.reduce_sum(tf.cast(out, tf.float64) * tf.cast(upstream, tf.float64))
    grads = tape.gradient(loss, shards + values)
    assert out.dtype == dtype and tuple(out.shape) == (6, 3 * dim)
    want_dp = np.zeros((18, dim))
    scale_dp = np.zeros((18, dim))
    for t, (b, n, lo) in enumerate(zip(bags, num_rows, row_offsets)):
        table64 = params64[lo : lo + n]
        cols = slice(t * dim, (t + 1) * dim)
        want, dp, dw = bag_data.reference_all(
            table64, b, weights64[t], upstream64[:, cols], combiner, padding_ids[t]
        )
        bag_data.assert_close(out.numpy()[:, cols], want[0], want[1], dtype, f"output {t}")
        want_dp[lo : lo + n] += dp[0]
        scale_dp[lo : lo + n] += dp[1]
        if weighted:
            got_dw = b.csr_from_values(bag_data.dense_value(grads[3 + t]))
            bag_data.assert_close(got_dw, dw[0], dw[1], dtype, f"weights grad {t}")
    for s, (grad, lo, hi) in enumerate(zip(grads[:3], offsets[:-1], offsets[1:])):
        assert isinstance(grad, tf.IndexedSlices), (s, type(grad))
        assert int(grad.dense_shape[0]) == hi - lo
        bag_data.assert_close(
            bag_data.dense_value(grad), want_dp[lo:hi], scale_dp[lo:hi], dtype, f"shard {s}"
        )


def test_sharded_grouped_lookup_errors_and_unsharded(rng):
    table = rng.normal(size=(9, 2))
    shards = [tf.Variable(table[:4]), tf.Variable(table[4:])]
    ids = [tf.constant([[0, 3], [1, 1]]), tf.constant([[4], [0]])]
    lookup = distribute.sharded_grouped_gather_reduce_sum
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature b: indices\[0\] = 5"):
        lookup(shards, [ids[0], tf.constant([[5], [0]])], num_rows=[4, 5], labels=["a", "b"])
    with pytest.raises(ValueError, match=r"params has 9 rows but the features' tables need 10"):
        lookup(shards, ids, num_rows=[4, 5], row_offsets=[0, 5])
    with pytest.raises(ValueError, match="combiner 'max' does not take weights"):
        lookup(shards, ids, [None, tf.ones([2, 1], tf.float64)], num_rows=[4, 5], combiner="max")
    with pytest.raises(ValueError, match=r"shard 1 is \(5, 1\) float64"):
        lookup([shards[0], tf.Variable(table[4:, :1])], ids, num_rows=[4, 5])
    want = np.concatenate([table[[0, 3]].sum(0, keepdims=True), table[[1, 1]].sum(0)[None]])
    want = np.concatenate([want, table[[4 + 4, 4 + 0]]], axis=1)
    sharded = tf.function(lambda ids: lookup(shards, ids, num_rows=[4, 5]))(ids)
    np.testing.assert_allclose(sharded.numpy(), want, rtol=1e-12)
    # Not sharded: the plain grouped op.
    whole = lookup(tf.Variable(table), ids, num_rows=[4, 5])
    np.testing.assert_allclose(whole.numpy(), want, rtol=1e-12)
