"""tf_ttemb.export_for_serving: SavedModels of our layers served by stock TensorFlow.

The module fixture `served` exports every case (each layer alone, all four layers in one
model, int8 and float16 tables), writes the inputs of every signature, and serves all of
it in one fresh interpreter that cannot import tf_ttemb and has no op library on its
path (`run_fresh_python(..., without_tf_ttemb=True)`): that process records the outputs,
every op type of each SavedModel (graphs and function libraries) and the errors of the
calls with bad ids. The tests compare those outputs with the custom-op model's in this
process. The quantised lookup and the argument checks are tested in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import json
import zlib

import keras
import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import COMBINER_WEIGHTING, assert_close, combiner_id, make_bags, weights_like
from processes import our_message, run_fresh_python

import tf_ttemb
from tf_ttemb import serving
from tf_ttemb.layers import (
    EmbeddingBag,
    ProductKeyMemory,
    TableBatchedTTEmbeddingBag,
    TTEmbeddingBag,
)
from tf_ttemb.ops import quantized

BATCH = 6

# --------------------------------------------------------------------------------------
# Inputs of every form, for the model here and for the signatures there.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bag:
    """A bag input: its table's rows and padding id, optional hot ids, optional weights."""

    rows: int
    padding_id: int | None = None
    hot: np.ndarray | None = None  # ids drawn half of the time (cached TT rows)
    weights: str | None = None  # name of the weights input that goes with these ids


def _bag_lists(rng, bag: Bag, form: str):
    """Per-bag id lists (dense: all of one length; else some empty) and weight lists."""
    lengths = np.full(BATCH, 4) if form == "dense" else rng.integers(0, 6, size=BATCH)
    if form != "dense":
        lengths[1] = 0
    ids, weights = [], []
    for n in lengths:
        row = rng.integers(0, bag.rows, size=n)
        if bag.hot is not None:
            row = np.where(rng.random(n) < 0.5, rng.choice(bag.hot, size=n), row)
        if bag.padding_id is not None:
            row = np.where(rng.random(n) < 0.25, bag.padding_id, row)
        ids.append(row.astype(np.int64))
        weights.append(rng.uniform(0.5, 1.5, size=n).astype(np.float32))
    return ids, weights


def _form_tensors(name: str, lists, form: str, order=None):
    """(the model's tensor, the signature's arrays by key) of one bag input."""
    if form == "dense":
        values = np.stack(lists)
        return tf.constant(values), {name: values}
    values = np.concatenate(lists)
    lengths = np.array([len(x) for x in lists], np.int64)
    if form == "ragged":
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tensor = tf.RaggedTensor.from_row_splits(values, splits)
        return tensor, {f"{name}_values": values, f"{name}_row_splits": splits}
    coords = np.array([[b, j] for b, n in enumerate(lengths) for j in range(n)], np.int64)
    coords = coords.reshape(-1, 2)[order]
    dense_shape = np.array([len(lists), lengths.max() + 1], np.int64)
    tensor = tf.SparseTensor(coords, values[order], dense_shape)
    return tensor, {
        f"{name}_indices": coords,
        f"{name}_values": values[order],
        f"{name}_dense_shape": dense_shape,
    }


@dataclasses.dataclass
class Case:
    """A model, how it is exported, and the kinds of tables the export must hold."""

    name: str
    model: keras.Model
    bags: dict  # input name -> Bag
    dense: dict  # input name -> rng -> array (non-bag inputs)
    export: dict
    kinds: dict  # layer name -> ExportedTable.kind
    dtype: tf.DType = tf.float32
    forms: tuple = serving.FORMS
    bad: tuple | None = None  # (bag input, its rows): the input of the bad-id calls
    expect: contextlib.AbstractContextManager | None = None  # tables as the export holds them

    def feeds(self, rng, form: str):
        """(model inputs in model.inputs order, signature arrays by key)."""
        lists = {n: _bag_lists(rng, b, form) for n, b in self.bags.items()}
        orders = {n: rng.permutation(sum(len(x) for x in ids)) for n, (ids, _) in lists.items()}
        # The model gets sparse ids it does not declare sparse as the equivalent ragged
        # ids, as the export hands them over (Keras would densify them).
        declared_sparse = {t.name: t.sparse for t in self.model.inputs}
        tensors, arrays = {}, {}
        for name, bag in self.bags.items():
            ids, weights = lists[name]
            pairs = [(name, ids)] + ([(bag.weights, weights)] if bag.weights else [])
            for key, values in pairs:
                _, part = _form_tensors(key, values, form, orders[name])
                arrays.update(part)
                model_form = "ragged" if form == "sparse" and not declared_sparse[key] else form
                tensors[key], _ = _form_tensors(key, values, model_form, orders[name])
        for name, make in self.dense.items():
            value = make(rng)
            tensors[name] = tf.constant(value)
            arrays[name] = value
        ordered = [tensors[t.name] for t in self.model.inputs]
        return (ordered[0] if len(ordered) == 1 else ordered), arrays


def _train_pkm_statistics(model, inputs):
    """A few training-mode calls: the query batch norm's moving statistics move."""
    for _ in range(3):
        model(inputs, training=True)


def _ragged_input(name, dtype="int64"):
    return keras.Input(shape=(None,), dtype=dtype, ragged=True, name=name)


def _populated_tt(num_embeddings, dim, rng, **kwargs):
    """A built TT layer with a filled cache whose rows differ from the cores' rows."""
    layer = TTEmbeddingBag(
        num_embeddings,
        dim,
        tt_ranks=[3, 3],
        use_cache=True,
        cache_size=16,
        hashtbl_size=64,
        seed=int(rng.integers(2**31)),
        **kwargs,
    )
    hot = rng.choice(num_embeddings, size=12, replace=False)
    layer(tf.ragged.constant([list(hot) * 3], dtype=tf.int64), training=True)
    layer.cache_populate()
    layer.cache_rows.assign(layer.cache_rows + tf.random.normal(layer.cache_rows.shape, 0, 0.1))
    return layer, hot


def _embedding_bag_model(rng, dtype="float32"):
    ids, ids2 = (
        _ragged_input("ids"),
        keras.Input(shape=(None,), dtype="int64", name="ids2"),
    )
    weights = _ragged_input("w", "float32")
    first = EmbeddingBag(64, 8, combiner="mean", padding_id=-1, name="bag_mean")(ids)
    second = EmbeddingBag(40, 8, combiner="sqrtn", name="bag_weighted")(ids2, weights)
    score = keras.layers.Dense(3, name="score")(keras.layers.Concatenate()([first, second]))
    bags = {"ids": Bag(64, -1), "ids2": Bag(40, weights="w")}
    return keras.Model([ids, ids2, weights], score), bags


@contextlib.contextmanager
def _dequantized(variables, mode):
    """The variables hold their quantised-and-dequantised values inside the block."""
    saved = [v.numpy() for v in variables]
    try:
        for v, value in zip(variables, saved):
            q = quantized.quantize_rows(value, mode)
            rows = q.codes.astype(np.float32)
            if q.scale is not None:
                rows = rows * q.scale[:, None] + q.bias[:, None]
            v.assign(rows)
        yield
    finally:
        for v, value in zip(variables, saved):
            v.assign(value)


def _all_four_model(rng):
    a, b = _ragged_input("a"), _ragged_input("b")
    cs = [_ragged_input(f"c{t}") for t in range(3)]
    x = keras.Input(shape=(4, 6), name="x")
    tt, hot = _populated_tt(1000, 8, rng, padding_id=-1, name="tt")
    batched = TableBatchedTTEmbeddingBag(
        3, 200, 8, tt_ranks=4, combiner="sqrtn", seed=3, name="batched"
    )
    pkm = ProductKeyMemory(n_keys=8, k_dim=4, heads=2, knn=2, name="pkm")
    bag = EmbeddingBag(50, 8, combiner="mean", padding_id=-1, name="bag")
    tables = keras.ops.reshape(keras.ops.transpose(batched(cs), [1, 0, 2]), [-1, 24])
    memory = keras.ops.mean(pkm(x), axis=1)
    joined = keras.layers.Concatenate()([bag(a), tt(b), tables, memory])
    model = keras.Model([a, b] + cs + [x], keras.layers.Dense(1, name="score")(joined))
    bags = {"a": Bag(50, -1), "b": Bag(1000, -1, hot=hot)}
    bags.update({f"c{t}": Bag(200) for t in range(3)})
    dense = {"x": lambda r: r.normal(size=(BATCH, 4, 6)).astype(np.float32)}
    _train_pkm_statistics(pkm, tf.constant(rng.normal(size=(16, 4, 6)), tf.float32))
    return model, bags, dense


def _one_bag_case(
    name: str,
    ids,
    bag: EmbeddingBag,
    *,
    dtype: tf.DType = tf.float32,
    forms: tuple = serving.FORMS,
) -> Case:
    """A model of one EmbeddingBag `bag` on the bag input `ids`, its table exported dense;
    the bad-id calls send it id `input_dim`."""
    return Case(
        name,
        keras.Model(ids, bag(ids)),
        {ids.name: Bag(bag.input_dim, bag.padding_id)},
        {},
        {},
        {bag.name: "dense"},
        dtype=dtype,
        forms=forms,
        bad=(ids.name, bag.input_dim),
    )


def _cases(rng) -> list:
    cases = []
    model, bags = _embedding_bag_model(rng)
    cases.append(
        Case(
            "embedding_bag",
            model,
            bags,
            {},
            {},
            {"bag_mean": "dense", "bag_weighted": "dense"},
            bad=("ids", 64),
        )
    )
    layers = [
        model.get_layer("bag_mean").embeddings,
        model.get_layer("bag_weighted").embeddings,
    ]
    cases.append(
        Case(
            "embedding_bag_float16",
            model,
            bags,
            {},
            {"quantize": "float16"},
            {"bag_mean": "float16", "bag_weighted": "float16"},
            forms=("sparse",),
            expect=lambda: _dequantized(layers, "float16"),
        )
    )

    cases.append(
        _one_bag_case(
            "sparse_input",
            keras.Input(shape=(None,), dtype="int64", sparse=True, name="ids"),
            EmbeddingBag(25, 4, combiner="sum", padding_id=-1, name="bag"),
        )
    )
    cases.append(
        _one_bag_case(
            "embedding_bag_float64",
            _ragged_input("ids"),
            EmbeddingBag(30, 5, combiner="max", padding_id=-1, dtype="float64", name="bag64"),
            dtype=tf.float64,
            forms=("ragged", "dense"),
        )
    )

    ids = _ragged_input("ids")
    tt, hot = _populated_tt(5000, 12, rng, combiner="mean", padding_id=-1, name="tt")
    tt_model = keras.Model(ids, keras.layers.Dense(2, name="score")(tt(ids)))
    tt_bags = {"ids": Bag(5000, -1, hot=hot)}
    cases.append(
        Case(
            "tt_rows",
            tt_model,
            tt_bags,
            {},
            {"tt_dense_max_mib": 0},
            {"tt": "tt_rows"},
            bad=("ids", 5000),
        )
    )
    cases.append(
        Case(
            "tt_dense",
            tt_model,
            tt_bags,
            {},
            {},
            {"tt": "dense"},
            forms=("ragged",),
            bad=("ids", 5000),
        )
    )

    cs = [_ragged_input(f"c{t}") for t in range(3)]
    batched = TableBatchedTTEmbeddingBag(3, 300, 8, tt_ranks=4, seed=5, name="batched")
    flat = keras.ops.reshape(keras.ops.transpose(batched(cs), [1, 0, 2]), [-1, 24])
    cases.append(
        Case(
            "table_batched",
            keras.Model(cs, flat),
            {f"c{t}": Bag(300) for t in range(3)},
            {},
            {},
            {"batched": "dense"},
            bad=("c1", 300),
        )
    )

    tokens = keras.Input(shape=(5,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(20, 12, mask_zero=True)(tokens)
    pkm = ProductKeyMemory(n_keys=16, k_dim=8, heads=2, knn=4, name="pkm")
    pooled = keras.layers.GlobalAveragePooling1D()(pkm(hidden))
    pkm_model = keras.Model(tokens, keras.layers.Dense(2, name="score")(pooled))
    _train_pkm_statistics(pkm_model, tf.constant(rng.integers(0, 20, size=(16, 5)), tf.int32))
    cases.append(
        Case(
            "pkm",
            pkm_model,
            {},
            {"tokens": lambda r: r.integers(0, 20, size=(BATCH, 5)).astype(np.int32)},
            {"bag_inputs": ()},
            {"pkm": "dense"},
            forms=("dense",),
        )
    )

    model, bags, dense = _all_four_model(rng)
    kinds = {"bag": "dense", "tt": "tt_rows", "batched": "dense", "pkm": "dense"}
    # Dense tables: batched 3 x 200 x 8 x 4 bytes = 0.018 MiB; tt 1000 x 8 x 4 = 0.031 MiB.
    cases.append(
        Case(
            "all_four",
            model,
            bags,
            dense,
            {"tt_dense_max_mib": 0.025},
            kinds,
            bad=("b", 1000),
        )
    )
    int8 = [model.get_layer("bag").embeddings, model.get_layer("pkm").values]
    cases.append(
        Case(
            "all_four_int8",
            model,
            bags,
            dense,
            {"quantize": "int8", "tt_dense_max_mib": 0},
            {"bag": "int8", "tt": "tt_rows", "batched": "tt_rows", "pkm": "int8"},
            forms=("ragged",),
            bad=("a", 50),
            expect=lambda: _dequantized(int8, "int8"),
        )
    )
    return cases


# --------------------------------------------------------------------------------------
# The fresh process: stock TensorFlow only.
# --------------------------------------------------------------------------------------

SERVE = r"""
import importlib.util, json, os, sys
import numpy as np

report = {"importable": importlib.util.find_spec("tf_ttemb") is not None}
try:
    import tf_ttemb  # noqa: F401
    report["import"] = "succeeded"
except ImportError as error:
    report["import"] = type(error).__name__
report["on_path"] = [p for p in sys.path if os.path.exists(os.path.join(p or ".", "tf_ttemb"))]

import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.python.framework import op_def_registry

manifest = json.load(open(sys.argv[1]))
directory = os.path.dirname(sys.argv[1])
report["cases"] = {}


def op_types(path):
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    types = set()
    for graph in proto.meta_graphs:
        types |= {node.op for node in graph.graph_def.node}
        for function in graph.graph_def.library.function:
            types |= {node.op for node in function.node_def}
    return sorted(types)


def load(files):
    return {k: tf.constant(np.load(os.path.join(directory, f))) for k, f in files.items()}


def structured(inputs, arrays):
    args = []
    for name, form in inputs:
        if form == "ragged":
            args.append(tf.RaggedTensor.from_row_splits(
                arrays[name + "_values"], arrays[name + "_row_splits"]))
        elif form == "sparse":
            args.append(tf.SparseTensor(arrays[name + "_indices"], arrays[name + "_values"],
                                        arrays[name + "_dense_shape"]))
        else:
            args.append(arrays[name])
    return args[0] if len(args) == 1 else args


for case in manifest:
    loaded = tf.saved_model.load(case["path"])
    result = {"ops": op_types(case["path"]), "signatures": sorted(loaded.signatures.keys()),
              "errors": {}}
    for call in case["calls"]:
        arrays = load(call["feeds"])
        try:
            if "function" in call:
                out = {"output": getattr(loaded, call["function"])(
                    structured(call["inputs"], arrays))}
            else:
                out = loaded.signatures[call["signature"]](**arrays)
            for key, value in out.items():
                np.save(os.path.join(directory, f"{call['id']}-{key}.npy"), value.numpy())
            result["errors"][call["id"]] = None
        except Exception as error:  # recorded; the test decides
            result["errors"][call["id"]] = [type(error).__name__, str(error)]
    report["cases"][case["name"]] = result

report["registered"] = op_def_registry.get("TfTtemb>GatherReduceSum") is not None
report["library_mapped"] = "_tf_ttemb_ops" in open("/proc/self/maps").read()
print(json.dumps(report))
"""


@dataclasses.dataclass
class Served:
    cases: dict  # name -> Case
    exports: dict  # name -> ServingExport
    want: dict  # call id -> expected output
    calls: dict  # call id -> (case name, kind, detail)
    report: dict
    directory: object

    def output(self, call_id: str, key: str):
        return np.load(self.directory / f"{call_id}-{key}.npy")


def _call(calls, manifest_calls, directory, case, call_id, kind, feeds, **extra):
    files = {}
    for key, value in feeds.items():
        files[key] = f"{call_id}-in-{key}.npy"
        np.save(directory / files[key], value)
    manifest_calls.append({"id": call_id, "feeds": files, **extra})
    calls[call_id] = (case.name, kind)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    rng = np.random.default_rng(zlib.crc32(b"test_serving"))
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    directory = tmp_path_factory.mktemp("serving")
    cases, exports, want, calls, manifest = {}, {}, {}, {}, []
    for case in _cases(rng):
        path = directory / case.name
        exports[case.name] = tf_ttemb.export_for_serving(
            case.model, path, forms=case.forms, **case.export
        )
        cases[case.name] = case
        entry = {"name": case.name, "path": str(path), "calls": []}
        for form in case.forms:
            inputs, arrays = case.feeds(rng, form)
            with case.expect() if case.expect else contextlib.nullcontext():
                expected = case.model(inputs).numpy()
            call_id = f"{case.name}-{form}"
            _call(
                calls,
                entry["calls"],
                directory,
                case,
                call_id,
                "output",
                arrays,
                signature=f"serve_{form}",
            )
            want[call_id] = expected
            if case.bad is None:
                continue
            name, rows = case.bad
            for bad in (rows, -7):
                key = name if form == "dense" else f"{name}_values"
                broken = dict(arrays)
                broken[key] = arrays[key].copy()
                broken[key].reshape(-1)[0] = bad
                _call(
                    calls,
                    entry["calls"],
                    directory,
                    case,
                    f"{call_id}-bad{bad}",
                    ("bad", bad, rows),
                    broken,
                    signature=f"serve_{form}",
                )
        if case.name == "all_four":
            inputs, arrays = case.feeds(rng, "ragged")
            want["all_four-function"] = case.model(inputs).numpy()
            order = [(t.name, "dense" if t.name == "x" else "ragged") for t in case.model.inputs]
            _call(
                calls,
                entry["calls"],
                directory,
                case,
                "all_four-function",
                "output",
                arrays,
                function="serve_ragged",
                inputs=order,
            )
            inputs, arrays = case.feeds(rng, "dense")
            want["all_four-default"] = case.model(inputs).numpy()
            _call(
                calls,
                entry["calls"],
                directory,
                case,
                "all_four-default",
                "output",
                arrays,
                signature="serving_default",
            )
            _, arrays = case.feeds(rng, "ragged")
            arrays["a_row_splits"] = arrays["a_row_splits"][::-1].copy()
            _call(
                calls,
                entry["calls"],
                directory,
                case,
                "all_four-bad-splits",
                ("splits",),
                arrays,
                signature="serve_ragged",
            )
            _, arrays = case.feeds(rng, "sparse")
            arrays["c0_indices"] = arrays["c0_indices"].copy()
            arrays["c0_indices"][0, 0] = BATCH + 2
            _call(
                calls,
                entry["calls"],
                directory,
                case,
                "all_four-bad-coordinates",
                ("coordinates", BATCH + 2),
                arrays,
                signature="serve_sparse",
            )
        manifest.append(entry)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    report = json.loads(
        run_fresh_python(
            SERVE, str(directory / "manifest.json"), without_tf_ttemb=True, timeout=240
        )
    )
    return Served(cases, exports, want, calls, report, directory)


CASE_NAMES = [
    "embedding_bag",
    "embedding_bag_float16",
    "sparse_input",
    "embedding_bag_float64",
    "tt_rows",
    "tt_dense",
    "table_batched",
    "pkm",
    "all_four",
    "all_four_int8",
]


def test_serving_process_cannot_import_tf_ttemb(served):
    report = served.report
    assert report["importable"] is False
    assert report["import"] == "ModuleNotFoundError"
    assert report["on_path"] == []
    assert report["registered"] is False, "a TfTtemb op was registered in the serving process"
    assert report["library_mapped"] is False, "the op library was loaded in the serving process"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_graph_holds_only_stock_ops(served, name):
    ops = served.report["cases"][name]["ops"]
    assert "GatherV2" in ops or "ResourceGather" in ops, ops  # the listing saw the lookups
    assert [op for op in ops if "TfTtemb" in op] == []
    # The op types this process knows without tf_ttemb: TensorFlow's own registry.
    assert serving.saved_model_op_types(served.exports[name].path) == set(ops)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_export_summary(served, name):
    export, case = served.exports[name], served.cases[name]
    assert {t.layer: t.kind for t in export.tables} == case.kinds
    first = f"serve_{case.forms[0]}"
    assert export.signatures["serving_default"] == export.signatures[first]
    assert sorted(served.report["cases"][name]["signatures"]) == sorted(
        ["serving_default"] + [f"serve_{f}" for f in case.forms]
    )
    for table in export.tables:
        if table.kind == "int8":
            rows, dim = table.shape[-2:]
            assert table.nbytes == rows * (dim + 8)
        elif table.kind == "float16":
            assert table.nbytes * 2 == table.dense_nbytes
        elif table.kind == "tt_rows":
            assert table.nbytes < table.dense_nbytes


_FORMS = {
    "embedding_bag": serving.FORMS,
    "embedding_bag_float16": ("sparse",),
    "sparse_input": serving.FORMS,
    "embedding_bag_float64": ("ragged", "dense"),
    "tt_rows": serving.FORMS,
    "tt_dense": ("ragged",),
    "table_batched": serving.FORMS,
    "pkm": ("dense",),
    "all_four": serving.FORMS,
    "all_four_int8": ("ragged",),
}
OUTPUT_CALLS = [f"{name}-{form}" for name, forms in _FORMS.items() for form in forms] + [
    "all_four-function",
    "all_four-default",
]


@pytest.mark.parametrize("call_id", OUTPUT_CALLS)
def test_served_outputs_equal_the_custom_op_model(served, call_id):
    name = served.calls[call_id][0]
    assert served.cases[name].forms == _FORMS[name]
    error = served.report["cases"][name]["errors"][call_id]
    assert error is None, error
    key = "output" if call_id.endswith("-function") else served.exports[name].outputs[0]
    got = served.output(call_id, key)
    want = served.want[call_id]
    dtype = served.cases[name].dtype
    assert got.dtype == want.dtype
    assert_close(got, want, np.abs(want).max(), dtype, call_id)


def _bad_call_ids(served):
    return [c for c, (_, kind) in served.calls.items() if kind[0] == "bad"]


@pytest.mark.parametrize(
    "name", [n for n in CASE_NAMES if n not in ("pkm", "embedding_bag_float16")]
)
def test_bad_ids_raise_in_the_served_graph(served, name):
    bad_calls = [c for c in _bad_call_ids(served) if served.calls[c][0] == name]
    assert len(bad_calls) == 2 * len(served.cases[name].forms)
    for call_id in bad_calls:
        _, (_, bad, rows) = served.calls[call_id]
        error = served.report["cases"][name]["errors"][call_id]
        assert error is not None, f"{call_id}: id {bad} was served"
        kind, message = error
        assert kind == "InvalidArgumentError", (call_id, error)
        assert f"] = {bad} is not in [0, {rows})" in our_message(message), (
            call_id,
            message,
        )


def test_bad_ragged_splits_and_sparse_coordinates_raise(served):
    errors = served.report["cases"]["all_four"]["errors"]
    kind, message = errors["all_four-bad-splits"]
    assert kind == "InvalidArgumentError" and "row_splits" in message, message
    kind, message = errors["all_four-bad-coordinates"]
    assert kind == "InvalidArgumentError", message
    assert f"= [{BATCH + 2}, " in message and "out of bounds for dense_shape" in message, message


# --------------------------------------------------------------------------------------
# In this process: the quantised lookup, the size rule, argument checks.
# --------------------------------------------------------------------------------------


def _dequantize(rows: quantized.QuantizedRows) -> np.ndarray:
    values = rows.codes.astype(np.float64)
    if rows.scale is None:
        return values
    return values * rows.scale[:, None].astype(np.float64) + rows.bias[:, None]


@pytest.mark.parametrize("mode", quantized.MODES)
def test_quantize_rows_error_bound(rng, mode):
    table = rng.normal(size=(300, 7)) * rng.uniform(0.01, 10, size=(300, 1))
    table[5] = 0.25  # a constant row
    rows = quantized.quantize_rows(table, mode)
    error = np.abs(_dequantize(rows) - table)
    if mode == "int8":
        assert rows.codes.dtype == np.int8 and rows.scale.dtype == np.float32
        span = table.max(axis=1) - table.min(axis=1)
        np.testing.assert_allclose(rows.scale, span / 255, rtol=1e-6)
        assert np.all(error <= rows.scale[:, None] * (0.5 + 1e-3) + 1e-6 * np.abs(table))
        assert error[5].max() == 0
        assert rows.nbytes == 300 * (7 + 8)
    else:
        np.testing.assert_array_equal(rows.codes, table.astype(np.float16))
        assert rows.scale is None and rows.nbytes == 300 * 7 * 2


def test_quantize_rows_refuses_non_finite_values():
    table = np.ones((4, 3))
    table[2, 1] = np.nan
    with pytest.raises(ValueError, match="row 2"):
        quantized.quantize_rows(table, "int8")
    with pytest.raises(ValueError, match="mode must be one of"):
        quantized.quantize_rows(table, "int4")


# Ragged ids reach the quantised lookup in the served all_four_int8 case.
@pytest.mark.parametrize("form", ["dense2d", "sparse"])
@pytest.mark.parametrize(
    "combiner,weighted",
    COMBINER_WEIGHTING,
    ids=[combiner_id(v) for v in COMBINER_WEIGHTING],
)
@pytest.mark.parametrize("mode", quantized.MODES)
def test_quantized_gather_reduce_sum_matches_reference(rng, mode, combiner, weighted, form):
    rows = quantized.quantize_rows(rng.normal(size=(40, 5)), mode)
    table = quantized.QuantizedRows(*(None if p is None else tf.constant(p) for p in rows))
    bags = make_bags(rng, form, 40, tf.int64, padding_id=-1)
    weights64 = rng.uniform(0.5, 1.5, size=bags.nnz) if weighted else None
    weights = None
    if weighted:
        values = tf.constant(bags.values_from_csr(weights64.astype(np.float32)), tf.float32)
        weights = weights_like(bags.ids, values)
        weights64 = weights64.astype(np.float32).astype(np.float64)
    want, scale = reference.forward(
        _dequantize(rows),
        bags.flat_ids,
        bags.splits,
        weights64,
        combiner,
        padding_id=-1,
    )
    want = want.reshape(bags.lead_shape + (5,))
    scale = scale.reshape(want.shape)

    def lookup(ids, w):
        return quantized.quantized_gather_reduce_sum(table, ids, w, combiner, padding_id=-1)

    eager = lookup(bags.ids, weights)
    assert eager.dtype == tf.float32
    assert_close(eager, want, scale, tf.float32, "eager")
    assert_close(tf.function(lookup)(bags.ids, weights), want, scale, tf.float32, "tf.function")


def test_quantized_gather_reduce_sum_bad_ids(rng):
    table = quantized.QuantizedRows(
        *(
            None if p is None else tf.constant(p)
            for p in quantized.quantize_rows(rng.normal(size=(10, 3)), "int8")
        )
    )
    ids = tf.ragged.constant([[1, -1, 3], [10]], dtype=tf.int64)
    message = r"indices\[3\] = 10 is not in \[0, 10\) and is not padding_id \(-1\)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        quantized.quantized_gather_reduce_sum(table, ids, padding_id=-1)
    graph = tf.function(lambda i: quantized.quantized_gather_reduce_sum(table, i))
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        graph(tf.constant([[2, -4]], tf.int64))
    assert our_message(info.value.message) == "indices[1] = -4 is not in [0, 10)"


@pytest.mark.parametrize("mode", quantized.MODES)
def test_tt_table_decompressed_and_quantised(rng, tmp_path, mode):
    layer = TTEmbeddingBag(
        500,
        6,
        tt_ranks=[4],
        tt_p_shapes=[20, 25],
        tt_q_shapes=[2, 3],
        combiner="sum",
        seed=7,
    )
    ids = keras.Input(shape=(None,), dtype="int64", ragged=True, name="ids")
    model = keras.Model(ids, layer(ids))
    export = tf_ttemb.export_for_serving(model, tmp_path, forms=["ragged"], quantize=mode)
    assert [(t.kind, t.shape, t.dense_nbytes) for t in export.tables] == [
        (mode, (500, 6), 500 * 6 * 4)
    ]
    bags = make_bags(rng, "ragged", 500, tf.int64)
    table = _dequantize(quantized.quantize_rows(layer.full_weight().numpy(), mode))
    want, scale = reference.forward(table, bags.flat_ids, bags.splits)
    got = tf.saved_model.load(str(tmp_path)).serve_ragged(bags.ids)
    assert_close(got, want, scale, tf.float32, mode)


def test_size_rule_picks_dense_or_tt_rows(tmp_path):
    layer = TTEmbeddingBag(1024, 8, tt_ranks=[4, 4], seed=1)  # dense: 32 KiB
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    model = keras.Model(ids, layer(ids))
    for limit, kind in [
        (1 / 32, "dense"),
        (1 / 32 - 1e-6, "tt_rows"),
        (0, "tt_rows"),
        (float("inf"), "dense"),
    ]:
        export = tf_ttemb.export_for_serving(
            model,
            tmp_path / str(len(list(tmp_path.iterdir()))),
            forms=["dense"],
            tt_dense_max_mib=limit,
        )
        assert [t.kind for t in export.tables] == [kind], limit
    assert serving.DEFAULT_TT_DENSE_MAX_MIB == 64.0


def _bag_model():
    ids = keras.Input(shape=(None,), dtype="int64", name="ids")
    return keras.Model(ids, EmbeddingBag(10, 2)(ids))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"quantize": "int4"},
            "quantize must be one of None, 'int8', 'float16', got 'int4'",
        ),
        (
            {"forms": ["csr"]},
            "forms entry must be one of 'dense', 'ragged', 'sparse', got 'csr'",
        ),
        ({"forms": []}, "forms must be a non-empty list of distinct forms, got []"),
        ({"forms": ["dense", "dense"]}, "distinct forms, got ['dense', 'dense']"),
        ({"tt_dense_max_mib": -1}, "tt_dense_max_mib must be a number >= 0, got -1"),
        (
            {"tt_dense_max_mib": "64"},
            "tt_dense_max_mib must be a number >= 0, got '64'",
        ),
        (
            {"bag_inputs": ["idz"]},
            ("bag_inputs ['idz'] are not inputs of the model; its inputs are ['ids']"),
        ),
        ({"bag_inputs": [], "forms": ["ragged"]}, "forms ['ragged'] need bag inputs"),
        ({"input_specs": tf.TensorSpec([None, 3], tf.int64)}, "wrap it in a list"),
        ({"input_specs": [3]}, "input_specs must hold tf.TensorSpec"),
    ],
)
def test_export_argument_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as info:
        tf_ttemb.export_for_serving(_bag_model(), tmp_path, **kwargs)
    assert message in str(info.value)


def test_export_needs_a_built_model_and_input_specs(tmp_path):
    with pytest.raises(ValueError, match="must be built"):
        tf_ttemb.export_for_serving(keras.Sequential([EmbeddingBag(10, 2)]), tmp_path)

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.bag = EmbeddingBag(10, 2)

        def call(self, ids, scale):
            return self.bag(ids) * scale

    model = Subclassed()
    model(tf.constant([[1, 2]]), tf.constant([[2.0]]))
    with pytest.raises(ValueError, match="pass input_specs"):
        tf_ttemb.export_for_serving(model, tmp_path)
    # With input_specs, positional arguments; the rank-2 integer one is the bag input.
    specs = [
        tf.TensorSpec([None, None], tf.int32, name="ids"),
        tf.TensorSpec([None, 1], tf.float32, name="scale"),
    ]
    export = tf_ttemb.export_for_serving(model, tmp_path, input_specs=specs, forms=["sparse"])
    assert export.signatures["serve_sparse"] == (
        "ids_indices",
        "ids_values",
        "ids_dense_shape",
        "scale",
    )
    ids = tf.SparseTensor([[0, 1], [1, 0]], tf.constant([3, 9], tf.int32), [2, 3])
    got = tf.saved_model.load(str(tmp_path)).serve_sparse(ids, tf.constant([[1.0], [3.0]]))
    np.testing.assert_allclose(got, model(ids, tf.constant([[1.0], [3.0]])), rtol=1e-6)


def test_export_refuses_a_model_that_calls_the_custom_op_directly(tmp_path):
    class Direct(keras.layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(10, 2), name="table")

        def call(self, ids):
            return tf_ttemb.gather_reduce_sum(self.table, ids, implementation="custom_op")

    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    model = keras.Model(ids, Direct()(ids))
    with pytest.raises(ValueError, match=r"still holds tf_ttemb custom ops \['TfTtemb>"):
        tf_ttemb.export_for_serving(model, tmp_path, forms=["dense"])


def test_form_the_model_cannot_take_is_named(tmp_path):
    class DenseOnly(keras.layers.Layer):
        def call(self, ids):
            return tf.convert_to_tensor(ids)  # raises for ragged ids

    ids = keras.Input(shape=(4,), dtype="int64", name="ids")
    model = keras.Model(ids, EmbeddingBag(10, 2)(DenseOnly()(ids)))
    with pytest.raises(ValueError, match=r"cannot be traced with ragged bag inputs \(\['ids'\]\)"):
        tf_ttemb.export_for_serving(model, tmp_path)
    export = tf_ttemb.export_for_serving(model, tmp_path, forms=["dense"])
    assert list(export.signatures) == ["serving_default", "serve_dense"]


def test_layers_outside_an_export_read_their_own_tables():
    layer = EmbeddingBag(10, 2)
    layer(tf.constant([[1]]))
    assert serving.serving_table(layer) is None


@pytest.mark.parametrize("module", [serving, quantized], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failures in {module.__name__}"
    assert result.attempted > 0
