"""tf.distribute under ParameterServerStrategy on a real localhost cluster (2 workers, 2
parameter servers): sharded EmbeddingBag tables, recovery from a killed worker, and
GroupedEmbeddingBag with its stacks whole on a parameter server or sharded by rows.
test_distribute.py has MirroredStrategy and the sharded lookups without a cluster.

Each scenario runs in fresh Python subprocesses (test_distribute.run_script) that print
JSON reports; the tests here check them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf
from test_distribute import TOLERANCE, run_script

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
