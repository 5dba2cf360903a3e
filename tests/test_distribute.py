"""tf.distribute: MirroredStrategy for every layer, sharded EmbeddingBag tables under
ParameterServerStrategy on a real localhost cluster, and recovery from a killed worker.

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


# --------------------------------------------------------------------------------------
# ParameterServerStrategy on a localhost cluster: 2 workers, 2 parameter servers.
# --------------------------------------------------------------------------------------

# Starts the cluster's servers: `IN_PROCESS` ones in this process (what TF's in-process
# cluster examples do), the others as `tf.distribute.Server` subprocesses that import
# tf_ttemb first (every task must have the ops registered).
CLUSTER = """
    import json, os, socket, subprocess, sys, time
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_ttemb
    from tf_ttemb import distribute

    def free_port():
        with socket.socket() as s:
            s.bind(("localhost", 0))
            return s.getsockname()[1]

    SPEC = {"worker": [f"localhost:{free_port()}" for _ in range(2)],
            "ps": [f"localhost:{free_port()}" for _ in range(2)]}
    SERVER = (
        "import json, sys\\n"
        "import tensorflow as tf\\n"
        "import tf_ttemb\\n"
        "server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(sys.argv[1])),\\n"
        "    job_name=sys.argv[2], task_index=int(sys.argv[3]), protocol='grpc', start=True)\\n"
        "print('ready', flush=True)\\n"
        "server.join()\\n")
    REPO = os.getcwd()

    def start_server(job, index, cwd):
        return subprocess.Popen(
            [sys.executable, "-c", SERVER, json.dumps(SPEC), job, str(index)],
            stdout=subprocess.PIPE, cwd=cwd, env=dict(os.environ, PYTHONPATH=REPO))

    def connect(in_process, partitioner):
        servers = [tf.distribute.Server(tf.train.ClusterSpec(SPEC), job_name=job,
                                        task_index=index, protocol="grpc", start=True)
                   for job, index in in_process]
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(SPEC), rpc_layer="grpc")
        strategy = tf.distribute.ParameterServerStrategy(
            resolver, variable_partitioner=partitioner)
        return servers, strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)

    def graph_report(graph, variables):
        # The types of the ops that use the variables' handles (captured into the function
        # as placeholders), and the devices of the lookups.
        handles = {id(internal) for external, internal in graph.captures
                   if any(external is v.handle for v in variables)}
        users = sorted({op.type for op in graph.get_operations()
                        if any(id(t) in handles for t in op.inputs)})
        lookups = sorted({op.device for op in graph.get_operations()
                          if op.type == "TfTtemb>ResourceGatherReduceSum"})
        return users, lookups
"""

PS_LOOKUP = (
    CLUSTER
    + """
    data = np.load(sys.argv[1])
    N, D, LR = data["table"].shape[0], data["table"].shape[1], 0.5
    servers, strategy, coordinator = connect(
        [("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1)],
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    COMBINERS = ("sum", "mean", "sqrtn", "max")
    with strategy.scope():
        layers = [tf_ttemb.layers.EmbeddingBag(N, D, combiner=c, padding_id=int(data["padding"]),
                                               dtype="float64") for c in COMBINERS]
        for layer in layers:
            layer.build(None)
            layer.embeddings.assign(data["table"])
        # Keras optimizers take the shard variables (Keras 3 cannot differentiate w.r.t. a
        # Keras variable holding a ShardedVariable).
        shards = [s for layer in layers for s in distribute.shards_of(layer.embeddings)]
        optimizer = keras.optimizers.SGD(LR)
        optimizer.build(shards)
    ids = tf.RaggedTensor.from_row_splits(data["ids"], data["splits"])
    weights = ids.with_flat_values(tf.constant(data["weights"]))
    graphs = []

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                outputs = [layer(ids, None if layer.combiner == "max" else weights)
                           for layer in layers]
                loss = tf.add_n([tf.reduce_sum(out * data["dy"]) for out in outputs])
            grads = tape.gradient(loss, shards)
            optimizer.apply(grads, shards)
            return outputs, [(g.indices, g.values) for g in grads]
        graphs.append(tf.compat.v1.get_default_graph())
        return strategy.run(replica)

    outputs, grads = coordinator.schedule(step).fetch()
    coordinator.join()
    users, lookups = graph_report(graphs[0], shards)
    result = {f"out_{c}": np.asarray(o) for c, o in zip(COMBINERS, outputs)}
    for k, (layer, c) in enumerate(zip(layers, COMBINERS)):
        for s in range(2):
            index, values = grads[2 * k + s]
            result[f"grad_{c}_{s}_indices"] = np.asarray(index)
            result[f"grad_{c}_{s}_values"] = np.asarray(values)
            result[f"after_{c}_{s}"] = distribute.shards_of(layer.embeddings)[s].numpy()
        layer_shards = distribute.shards_of(layer.embeddings)
        result[f"rows_{c}"] = np.asarray([v.shape[0] for v in layer_shards])
        result[f"devices_{c}"] = np.asarray([v.device for v in layer_shards])
    np.savez(sys.argv[2], **result)
    print(json.dumps({"handle_users": users, "lookup_devices": lookups}), flush=True)
"""
)


def test_parameter_server_sharded_embedding_bag(rng, tmp_path):
    """EmbeddingBag tables sharded over 2 parameter servers: every combiner (weights,
    padding, an empty bag) equals the float64 reference of the unsharded table, each
    shard's lookup runs on its parameter server, the table is never read whole, and one
    SGD step moves only the touched rows of each shard by their IndexedSlices gradient."""
    import reference

    num_rows, dim, padding = 13, 3, 5
    lengths = np.array([3, 0, 4, 2, 5])
    flat = rng.integers(0, num_rows, size=lengths.sum())
    flat[[1, 7]] = padding
    splits = np.concatenate([[0], np.cumsum(lengths)])
    table = rng.normal(size=(num_rows, dim))
    weights = rng.uniform(0.5, 2.0, size=flat.shape)
    dy = rng.normal(size=(len(lengths), dim))
    np.savez(
        tmp_path / "in.npz",
        table=table,
        ids=flat,
        splits=splits,
        weights=weights,
        dy=dy,
        padding=padding,
    )
    reports = run_script(PS_LOOKUP, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    got = np.load(tmp_path / "out.npz")
    report = reports[-1]
    assert report["lookup_devices"] == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
    ], report
    # The shards are only read by the fused op (and its gradient, and the tape's empty
    # sparse read) and written by the optimizer's row scatter: never read whole.
    assert "ReadVariableOp" not in report["handle_users"], report
    assert "TfTtemb>ResourceGatherReduceSum" in report["handle_users"], report
    touched = np.unique(flat[flat != padding])
    for combiner in ("sum", "mean", "sqrtn", "max"):
        w = None if combiner == "max" else weights
        want, scale = reference.forward(table, flat, splits, w, combiner, padding)
        np.testing.assert_allclose(
            got[f"out_{combiner}"], want, rtol=1e-10, atol=1e-12 * scale.max()
        )
        want_grad, _ = reference.params_grad(table, flat, splits, dy, w, combiner, padding)
        rows = got[f"rows_{combiner}"]
        assert list(rows) == [7, 6], rows
        assert [str(d) for d in got[f"devices_{combiner}"]] == [
            "/job:ps/replica:0/task:0/device:CPU:0",
            "/job:ps/replica:0/task:1/device:CPU:0",
        ]
        offsets = [0, rows[0], num_rows]
        for s in range(2):
            lo, hi = offsets[s], offsets[s + 1]
            index = got[f"grad_{combiner}_{s}_indices"]
            local_touched = touched[(touched >= lo) & (touched < hi)] - lo
            np.testing.assert_array_equal(np.sort(index), local_touched)
            dense = np.zeros((hi - lo, dim))
            np.add.at(dense, index, got[f"grad_{combiner}_{s}_values"])
            np.testing.assert_allclose(dense, want_grad[lo:hi], rtol=1e-10, atol=1e-12)
            after, before = got[f"after_{combiner}_{s}"], table[lo:hi]
            np.testing.assert_allclose(
                after, before - 0.5 * want_grad[lo:hi], rtol=1e-10, atol=1e-12
            )
            untouched = np.setdiff1d(np.arange(hi - lo), local_touched)
            np.testing.assert_array_equal(after[untouched], before[untouched])


PS_RECOVERY = (
    CLUSTER
    + """
    import glob, signal
    data = np.load(sys.argv[1])
    tmp = sys.argv[2]
    N, D = data["table"].shape
    STEPS, MORE, LR = 8, 4, float(data["lr"])
    # Each worker process writes its marker files relative to its own working directory,
    # so where a marker appears tells which worker ran the step.
    DIRS = {"w0": f"{tmp}/w0", "w1": f"{tmp}/w1", "w1-restarted": f"{tmp}/w1r"}
    for d in DIRS.values():
        os.mkdir(d)
    w1 = start_server("worker", 1, DIRS["w1"])
    servers, strategy, coordinator = connect(
        [("worker", 0), ("ps", 0), ("ps", 1)],
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    assert w1.stdout.readline().strip() == b"ready"
    os.chdir(DIRS["w0"])  # worker 0 runs in this process
    with strategy.scope():
        layer = tf_ttemb.layers.EmbeddingBag(N, D, combiner="mean", dtype="float64")
        layer.build(None)
        layer.embeddings.assign(data["table"])
    shards = distribute.shards_of(layer.embeddings)

    def path(kind, i):
        return tf.strings.join([kind, "_", tf.strings.as_string(i)])

    @tf.function
    def step(i, ids, weights, dy):
        # Markers are unique per execution (a timestamp in the name): re-runs are counted.
        run = tf.strings.as_string(tf.timestamp(), precision=6)
        started = tf.io.write_file(tf.strings.join([path("started", i), "_", run]), "")
        with tf.control_dependencies([started]):
            go = path("go", i)

        # The step waits on its worker, before touching the parameter servers, until the
        # test creates its go file. The probed name depends on the loop counter so that
        # no graph optimization folds the check.
        def waiting(n):
            probe = tf.strings.join([go, tf.strings.substr(tf.strings.as_string(n), 0, 0)])
            return tf.equal(tf.size(tf.io.matching_files(probe)), 0)

        waited = tf.while_loop(waiting, lambda n: n + 1, [tf.constant(0, tf.int64)])[0]
        with tf.control_dependencies([waited]):
            ids, weights, dy = tf.identity(ids), tf.identity(weights), tf.identity(dy)

        def replica():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids, weights) * dy)
            grads = tape.gradient(loss, shards)
            updates = [s.scatter_sub(tf.IndexedSlices(LR * g.values, g.indices))
                       for s, g in zip(shards, grads)]
            with tf.control_dependencies(updates):
                return tf.io.write_file(tf.strings.join([path("done", i), "_", run]), "")

        strategy.run(replica)
        return i

    def schedule(steps):
        for i in steps:
            coordinator.schedule(step, args=(tf.constant(i), tf.constant(data["ids"][i]),
                                             tf.constant(data["weights"][i]),
                                             tf.constant(data["dy"][i])))

    def markers(kind, i):
        return sorted(w for w, d in DIRS.items() for _ in glob.glob(f"{d}/{kind}_{i}_*"))

    state = {"victim": None, "w1": w1}
    handled = set()
    released = []

    def in_flight():
        # A step let go whose done marker has not appeared yet.
        return any(who not in markers("done", i) for who, i in released)

    def serve(steps, hold_w0=False):
        # Lets waiting steps go, one at a time; kills worker 1 on the first step >= 2 it
        # holds. One at a time because two steps' scatter_sub on the same parameter-server
        # row can lose one of the updates: TensorFlow runs resource scatter ops on float
        # variables under a shared lock (Hogwild-style), and this test counts every update.
        for i in steps:
            for who in markers("started", i):
                if (who, i) in handled:
                    continue
                if state["victim"] is None and i >= 2 and who == "w1":
                    os.kill(state["w1"].pid, signal.SIGKILL)
                    state["w1"].wait()
                    state["victim"] = i
                    handled.add((who, i))
                    state["w1"] = start_server("worker", 1, DIRS["w1-restarted"])
                    continue
                if hold_w0 and who == "w0":
                    continue
                if in_flight():
                    return
                open(f"{DIRS[who]}/go_{i}", "w").close()
                handled.add((who, i))
                released.append((who, i))

    schedule(range(STEPS))
    deadline = time.time() + 120
    while (not coordinator.done() or state["victim"] is None) and time.time() < deadline:
        serve(range(STEPS))
        time.sleep(0.02)
    assert state["victim"] is not None, "worker 1 never held a step >= 2"
    coordinator.join()
    # Worker 1 comes back at its address; hold worker 0's steps until it has run one.
    assert state["w1"].stdout.readline().strip() == b"ready"
    schedule(range(STEPS, STEPS + MORE))
    deadline = time.time() + 60
    while not coordinator.done():
        rejoined = any("w1-restarted" in markers("started", j)
                       for j in range(STEPS, STEPS + MORE))
        serve(range(STEPS, STEPS + MORE), hold_w0=not rejoined and time.time() < deadline)
        time.sleep(0.02)
    coordinator.join()
    np.save(f"{tmp}/table.npy", np.concatenate([s.numpy() for s in shards]))
    print(json.dumps({
        "victim": state["victim"],
        "started": {i: markers("started", i) for i in range(STEPS + MORE)},
        "done": {i: markers("done", i) for i in range(STEPS + MORE)},
    }), flush=True)
    state["w1"].kill()
    os._exit(0)  # skip the coordinator's teardown RPCs to the killed worker
"""
)


def test_parameter_server_worker_killed_mid_training(rng, tmp_path):
    """A worker process is killed (SIGKILL) while it holds a scheduled training step, before
    the step has touched the parameter servers. As ClusterCoordinator documents, the step
    is re-run on the other worker, training continues, and the restarted worker rejoins;
    every step is applied exactly once (final table = initial - lr * sum of the steps'
    gradients: the loss is linear in the table, so the steps commute whatever their order).
    The steps' updates run one at a time (see serve()): concurrent scatter_sub on a
    parameter-server row is not atomic in TensorFlow, and a lost update once failed CI.
    """
    import reference

    num_rows, dim, steps, lr = 17, 3, 12, 0.25
    table = rng.normal(size=(num_rows, dim))
    ids = rng.integers(0, num_rows, size=(steps, 4, 3))
    weights = rng.uniform(0.5, 2.0, size=(steps, 4, 3))
    dy = rng.normal(size=(steps, 4, dim))
    np.savez(tmp_path / "in.npz", table=table, ids=ids, weights=weights, dy=dy, lr=lr)
    report = run_script(PS_RECOVERY, str(tmp_path / "in.npz"), str(tmp_path), timeout=400)[-1]
    victim = report["victim"]
    started, done = report["started"], report["done"]
    # The victim started on worker 1, never finished there, and was re-run elsewhere
    # (worker 0, or the restarted worker 1 if it was back first).
    assert "w1" in started[str(victim)] and len(started[str(victim)]) == 2, report
    assert done[str(victim)] in (["w0"], ["w1-restarted"]), report
    # Every step finished exactly once; the restarted worker ran some of the later ones.
    assert all(len(done[str(i)]) == 1 for i in range(steps)), report
    assert any(done[str(i)] == ["w1-restarted"] for i in range(8, steps)), report
    expected = table.copy()
    splits = np.arange(0, 13, 3)
    for i in range(steps):
        grad, _ = reference.params_grad(
            table, ids[i].reshape(-1), splits, dy[i], weights[i].reshape(-1), "mean"
        )
        expected -= lr * grad
    got = np.load(tmp_path / "table.npy")
    # A lost or doubled step would be off by lr * its gradient, far beyond rounding.
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------
# GroupedEmbeddingBag under ParameterServerStrategy: stacks whole on a parameter server,
# or sharded by rows with shard boundaries inside tables.
# --------------------------------------------------------------------------------------

# Two widths (two stacks); four lookups of width 4 (sum over two features, mean over two
# features sharing a table, max) and one of width 3. Stack 4 is user [0, 23), item
# [23, 40), tags [40, 49), page [49, 61): two shards split it at row 31, inside item's
# table; stack 3 (country, 6 rows) is split inside country's.
GROUPED_FEATURES = [
    {"name": "user", "input_dim": 23, "output_dim": 4},
    {"name": "item", "input_dim": 17, "output_dim": 4, "combiner": "mean", "padding_id": 0},
    {"name": "history", "input_dim": 17, "output_dim": 4, "combiner": "mean", "table": "item"},
    {"name": "tags", "input_dim": 9, "output_dim": 4, "combiner": "max"},
    {"name": "country", "input_dim": 6, "output_dim": 3},
    {"name": "page", "input_dim": 12, "output_dim": 4},
]
GROUPED_TABLES = {"user": (4, 0), "item": (4, 23), "tags": (4, 40), "page": (4, 49)}
GROUPED_TABLES["country"] = (3, 0)
GROUPED_TABLES["history"] = GROUPED_TABLES["item"]
GROUPED_DENSE = {"user": 1, "item": 3, "tags": 2, "country": 2}  # the others are ragged
GROUPED_WEIGHTED = ("item", "history")

PS_GROUPED = (
    CLUSTER
    + """
    data = np.load(sys.argv[1], allow_pickle=True)
    placement, dtype = sys.argv[3], sys.argv[4]
    features = json.loads(str(data["features"]))
    steps, lr = int(data["steps"]), float(data["lr"])
    partitioner = (tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
                   if placement.endswith("rows") else None)
    servers, strategy, coordinator = connect(
        [("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1)], partitioner)
    per_table = placement.startswith("table")
    with strategy.scope():
        layer = tf_ttemb.layers.GroupedEmbeddingBag(
            features, dtype=dtype, placement="table" if per_table else "stacked")
        layer.build(None)
        # Each width's tables, in the stack's row order.
        owned = {w: [n for n, v in layer.table_variables.items() if v.shape[1] == w]
                 for w in (4, 3)}
        for width in layer.stacked:
            layer.stacked[width].assign(data[f"stack_{width}"].astype(dtype))
        for width, names in owned.items():
            start = 0
            for name in names:
                variable = layer.table_variables[name]
                rows = variable.shape[0]
                variable.assign(data[f"stack_{width}"][start : start + rows].astype(dtype))
                start += rows
        # Differentiate w.r.t. the shards of a sharded stack or table (Keras 3 cannot take
        # a gradient w.r.t. a Keras variable holding a ShardedVariable), else the variable.
        variables = [s for v in layer.trainable_variables
                     for s in (distribute.shards_of(v) or [v])]
        optimizer = keras.optimizers.SGD(lr)
        optimizer.build(variables)
        try:
            tf_ttemb.layers.GroupedEmbeddingBag(features, sparse=True)
            refusal = None
        except ValueError as e:
            refusal = str(e)
    names = [f["name"] for f in features]
    ragged = [n for n in names if f"0_{n}_splits" in data.files]
    graphs, grad_types = [], set()

    @tf.function
    def step(args):
        def replica(args):
            inputs = {n: (tf.RaggedTensor.from_row_splits(args[n], args[n + "_splits"])
                          if n in ragged else args[n]) for n in names}
            weights = {n: (inputs[n].with_flat_values(args[n + "_weights"]) if n in ragged
                           else args[n + "_weights"]) for n in names if n + "_weights" in args}
            with tf.GradientTape() as tape:
                out = layer(inputs, weights)
                loss = tf.reduce_sum(tf.square(out - args["target"]))
            grads = tape.gradient(loss, variables)
            grad_types.update(type(g).__name__ for g in grads)
            optimizer.apply(grads, variables)
            return loss
        graphs.append(tf.compat.v1.get_default_graph())
        return strategy.run(replica, (args,))

    losses = []
    for i in range(steps):
        prefix = f"{i}_"
        args = {k[len(prefix):]: tf.constant(data[k].astype(dtype) if "weights" in k or
                                             "target" in k else data[k])
                for k in data.files if k.startswith(prefix)}
        # One step at a time: every step sees the previous one's update.
        losses.append(float(coordinator.schedule(step, args=(args,)).fetch()))
        coordinator.join()
    users, lookups = graph_report(graphs[0], variables)
    result = {}
    units = {str(w): [v] for w, v in layer.stacked.items()}  # report key -> variables
    units.update({n: [v] for n, v in layer.table_variables.items()})
    for width, names in owned.items():
        if names:
            units[str(width)] = [layer.table_variables[n] for n in names]
    for key, unit in units.items():
        shards = [s for v in unit for s in (distribute.shards_of(v) or [v])]
        values = np.concatenate([np.asarray(s.numpy()) for s in shards])
        if len(unit) > 1 or key in ("4", "3"):
            result[f"stack_{key}"] = values
        if len(unit) == 1:
            result[f"rows_{key}"] = np.asarray([s.shape[0] for s in shards])
            result[f"devices_{key}"] = np.asarray(
                [(s.value if isinstance(s, keras.Variable) else s).device for s in shards])
    result["table_item"] = layer.table("item").numpy()
    np.savez(sys.argv[2], **result)
    print(json.dumps({"handle_users": users, "lookup_devices": lookups, "losses": losses,
                      "grads": sorted(grad_types), "sparse_refusal": refusal}), flush=True)
"""
)


def _grouped_steps(rng, steps: int, batch: int) -> list:
    """Per step: each feature's ids (dense [B, L] or ragged flat + splits, an empty bag
    and padding entries among them), weights, and a target of [B, 19]."""
    out = []
    for _ in range(steps):
        step = {}
        for f in GROUPED_FEATURES:
            name, rows = f["name"], f["input_dim"]
            if name in GROUPED_DENSE:
                ids = rng.integers(0, rows, size=(batch, GROUPED_DENSE[name]))
            else:
                lengths = rng.integers(0, 5, size=batch)
                lengths[1] = 0  # an empty bag
                ids = rng.integers(0, rows, size=lengths.sum())
                step[name + "_splits"] = np.concatenate([[0], np.cumsum(lengths)])
            if f.get("padding_id") is not None:
                ids[rng.random(ids.shape) < 0.25] = f["padding_id"]
            step[name] = ids.astype(np.int64)
            if name in GROUPED_WEIGHTED:
                step[name + "_weights"] = rng.uniform(0.5, 2.0, size=ids.shape)
        step["target"] = rng.normal(size=(batch, sum(f["output_dim"] for f in GROUPED_FEATURES)))
        out.append(step)
    return out


def _grouped_reference(stacks: dict, data: list, lr: float) -> tuple[dict, list]:
    """float64 numpy: SGD on loss = sum((out - target)^2), step after step; the stacks
    after the steps and each step's loss."""
    import reference

    stacks = {w: s.astype(np.float64).copy() for w, s in stacks.items()}
    losses = []
    for step in data:
        outs, cuts = [], []
        for f in GROUPED_FEATURES:
            name = f["name"]
            width, offset = GROUPED_TABLES[name]
            table = stacks[width][offset : offset + f["input_dim"]]
            ids = step[name]
            splits = step.get(name + "_splits")
            if splits is None:
                splits = np.arange(0, ids.size + 1, ids.shape[1])
            weights = step.get(name + "_weights")
            weights = None if weights is None else weights.reshape(-1)
            args = (ids.reshape(-1), splits, weights, f.get("combiner", "sum"))
            outs.append((reference.forward(table, *args, f.get("padding_id"))[0], args))
            cuts.append(width)
        out = np.concatenate([o for o, _ in outs], axis=1)
        dy = 2.0 * (out - step["target"])
        losses.append(float(np.sum((out - step["target"]) ** 2)))
        grads = {w: np.zeros_like(s) for w, s in stacks.items()}
        start = 0
        for f, (_, args), width in zip(GROUPED_FEATURES, outs, cuts):
            _, offset = GROUPED_TABLES[f["name"]]
            table = stacks[width][offset : offset + f["input_dim"]]
            flat, splits, weights, combiner = args
            grad, _ = reference.params_grad(
                table,
                flat,
                splits,
                dy[:, start : start + width],
                weights,
                combiner,
                f.get("padding_id"),
            )
            grads[width][offset : offset + f["input_dim"]] += grad
            start += width
        for w in stacks:
            stacks[w] -= lr * grads[w]
    return stacks, losses


def _grouped_single_process(stacks: dict, data: list, lr: float, dtype: str) -> dict:
    """The same steps with the layer in this process, no strategy."""
    from tf_ttemb.layers import GroupedEmbeddingBag

    layer = GroupedEmbeddingBag(GROUPED_FEATURES, dtype=dtype)
    layer.build()
    for w, s in stacks.items():
        layer.stacked[w].assign(s.astype(dtype))
    variables = [layer.stacked[w] for w in sorted(layer.stacked)]
    import keras

    optimizer = keras.optimizers.SGD(lr)
    for step in data:
        inputs, weights = {}, {}
        for f in GROUPED_FEATURES:
            name = f["name"]
            ids = tf.constant(step[name])
            if name + "_splits" in step:
                ids = tf.RaggedTensor.from_row_splits(ids, tf.constant(step[name + "_splits"]))
            inputs[name] = ids
            if name + "_weights" in step:
                values = tf.constant(step[name + "_weights"].astype(dtype))
                weights[name] = ids.with_flat_values(values) if name + "_splits" in step else values
        with tf.GradientTape() as tape:
            out = layer(inputs, weights)
            loss = tf.reduce_sum(tf.square(out - step["target"].astype(dtype)))
        optimizer.apply(tape.gradient(loss, variables), variables)
    return {w: layer.stacked[w].numpy() for w in layer.stacked}


@pytest.mark.parametrize(
    "placement,dtype",
    [
        ("whole", "float64"),
        ("whole", "float32"),
        ("rows", "float64"),
        ("rows", "float32"),
        ("table", "float64"),
        ("table_rows", "float64"),
    ],
)
def test_parameter_server_grouped_embedding_bag(rng, tmp_path, placement, dtype):
    """GroupedEmbeddingBag on a cluster of 2 workers and 2 parameter servers, trained by
    ClusterCoordinator-scheduled SGD steps (sum, mean over a shared table with weights and
    padding, max, ragged bags with an empty one; two widths). "whole": each width's stack
    lives whole on one parameter server. "rows": FixedShardsPartitioner(2) shards each
    stack by rows, the boundary inside a table, and each shard is looked up where it
    lives. "table": placement="table", each table a variable placed whole on a parameter
    server (both servers hold tables). "table_rows": those tables each sharded by rows
    over both servers. After the steps the stacks (or the tables in stack order) equal the
    same steps in one process and a float64 numpy reference of them, untouched rows are
    unchanged, and the gradients are IndexedSlices (no op reads a stack, table or shard
    whole). sparse=True is refused under the strategy, naming it."""
    steps, batch, lr = 3, 6, 0.0625  # exact in float32 (Keras keeps it so)
    data = _grouped_steps(rng, steps, batch)
    stacks = {4: rng.uniform(-0.5, 0.5, size=(61, 4)), 3: rng.uniform(-0.5, 0.5, size=(6, 3))}
    stacks = {w: s.astype(dtype).astype(np.float64) for w, s in stacks.items()}
    arrays = {f"stack_{w}": s for w, s in stacks.items()}
    for i, step in enumerate(data):
        arrays.update({f"{i}_{k}": v for k, v in step.items()})
    np.savez(
        tmp_path / "in.npz",
        features=json.dumps(GROUPED_FEATURES),
        steps=steps,
        lr=lr,
        **arrays,
    )
    reports = run_script(
        PS_GROUPED, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"), placement, dtype
    )
    report = reports[-1]
    got = np.load(tmp_path / "out.npz")
    want, want_losses = _grouped_reference(stacks, data, lr)
    single = _grouped_single_process(stacks, data, lr, dtype)
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(report["losses"], want_losses, rtol=tolerance)
    ps_devices = ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    for width, rows in ((4, 61), (3, 6)):
        stack = got[f"stack_{width}"]
        np.testing.assert_allclose(stack, want[width], rtol=tolerance, atol=tolerance)
        np.testing.assert_allclose(stack, single[width], rtol=tolerance, atol=tolerance)
        # Training moved the stacks; rows no step read are bitwise unchanged.
        touched = np.zeros(rows, bool)
        for step in data:
            for f in GROUPED_FEATURES:
                w, offset = GROUPED_TABLES[f["name"]]
                if w == width:
                    ids = step[f["name"]].reshape(-1)
                    touched[offset + ids[ids != f.get("padding_id", -1)]] = True
        assert np.max(np.abs(stack - stacks[width])[touched]) > 1e-2, width
        np.testing.assert_array_equal(stack[~touched], stacks[width][~touched].astype(dtype))
        if placement.startswith("table"):
            continue
        devices = [str(d) for d in got[f"devices_{width}"]]
        if placement == "rows":
            assert list(got[f"rows_{width}"]) == [(rows + 1) // 2, rows // 2]
            assert devices == ps_devices, devices
        else:
            assert list(got[f"rows_{width}"]) == [rows]
            assert devices[0] in ps_devices, devices
    if placement == "whole":  # round robin: one stack on each parameter server
        assert {str(got["devices_4"][0]), str(got["devices_3"][0])} == set(ps_devices)
    elif placement == "rows":
        assert report["lookup_devices"] == ps_devices, report
    else:
        tables = {f.get("table", f["name"]): f["input_dim"] for f in GROUPED_FEATURES}
        placed = set()
        for name, rows in tables.items():
            devices = [str(d) for d in got[f"devices_{name}"]]
            placed.update(devices)
            if placement == "table_rows":
                assert list(got[f"rows_{name}"]) == [(rows + 1) // 2, rows // 2], name
                assert devices == ps_devices, (name, devices)
            else:
                assert list(got[f"rows_{name}"]) == [rows], name
                assert len(devices) == 1 and devices[0] in ps_devices, (name, devices)
        assert placed == set(ps_devices)  # the tables are spread over both servers
        assert set(ps_devices) <= set(report["lookup_devices"]), report
    assert report["sparse_refusal"].startswith(
        "GroupedEmbeddingBag(sparse=True) supports the strategies MirroredStrategy and "
        "OneDeviceStrategy only, got ParameterServerStrategy: the tables live on parameter "
        "servers"
    ), report
    np.testing.assert_allclose(got["table_item"], got["stack_4"][23:40], rtol=0, atol=0)
    assert report["grads"] == ["IndexedSlices"], report
    assert "ReadVariableOp" not in report["handle_users"], report
    assert "TfTtemb>ResourceGatherReduceSum" in report["handle_users"], report
