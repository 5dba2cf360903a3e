"""The demo's `tt_quality` section: a small CTR model with full against Tensor-Train
compressed tables (size, held-out quality, training speed), on data from a planted
logistic model."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

import tf_ttemb
from tf_ttemb.demo import _util
from tf_ttemb.ops import _loader

# ----------------------------------------------------------------------------------------
# Section `tt_quality`: a small CTR model with full vs Tensor-Train compressed tables.
#
# The data comes from a planted logistic model, so the best achievable held-out quality is
# known. Each example has `num_features` categorical ids (Zipf-distributed over a table of
# `rows` ids, scattered over the table by a fixed random permutation, as hashed ids are)
# and `dense_features` standard-normal dense features:
#
#   logit = sum_f <u_f[id_f], v_f> + <a, x_dense> + bias,   label ~ Bernoulli(sigmoid(logit))
#
# where u_f[id] is a random `planted_dim`-vector per id (uniform components of unit
# variance, computed on the fly from a seeded hash of (seed, feature, id, component), so
# no planted table is ever stored) and v_f a fixed random direction. Per id this is an
# arbitrary random number (no low-rank structure over the ids), so an embedding table
# genuinely helps, and a compressed table that cannot represent arbitrary per-id values
# genuinely loses something.


@dataclasses.dataclass(frozen=True)
class CtrTask:
    """The planted CTR task: sizes, id distribution and the scale of each logit term."""

    num_features: int = 3
    rows: int = 1_000_000
    dense_features: int = 4
    planted_dim: int = 8
    zipf_exponent: float = 1.1
    embedding_scale: float = 1.0  # std of each feature's term <u_f[id], v_f>
    dense_scale: float = 1.0  # std of <a, x_dense>
    bias: float = -1.0
    seed: int = 0

    def describe(self) -> str:
        """A one-line description for the report."""
        return (
            f"{self.num_features} sparse features (one id each, Zipf({self.zipf_exponent:g}) "
            f"over {self.rows:,} ids) + {self.dense_features} dense features; labels from a "
            f"planted logistic model over random {self.planted_dim}-dim per-id vectors"
        )


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic): a fast, good hash."""
    with np.errstate(over="ignore"):  # numpy warns on wrapping scalars, not arrays
        x = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def planted_vectors(task: CtrTask, feature: int, ids: np.ndarray) -> np.ndarray:
    """The planted vectors u_feature[ids], [..., planted_dim] float64.

    A pure function of (task.seed, feature, id): the same id gets the same vector in every
    batch and process, without storing a [rows, planted_dim] table. Components are uniform
    on [-sqrt(3), sqrt(3)] (mean 0, variance 1), independent across ids and components.
    """
    ids = np.asarray(ids, dtype=np.int64)
    key = _splitmix64(np.uint64(task.seed) * np.uint64(1_000_003) + np.uint64(feature))
    base = _splitmix64(ids.astype(np.uint64) ^ key)
    components = np.arange(task.planted_dim, dtype=np.uint64) * np.uint64(0x632BE59BD9B4E019)
    bits = _splitmix64(base[..., None] + components)
    uniform = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    return (2.0 * uniform - 1.0) * np.sqrt(3.0)


@dataclasses.dataclass(frozen=True)
class PlantedModel:
    """The fixed parameters of the planted model (besides the per-id vectors)."""

    directions: np.ndarray  # [num_features, planted_dim], v_f
    dense_weights: np.ndarray  # [dense_features], a
    permutations: np.ndarray  # [num_features, rows]: Zipf rank r -> id
    zipf_cdf: np.ndarray  # [rows], cumulative probabilities of ranks 1..rows


def planted_model(task: CtrTask) -> PlantedModel:
    """Draws v_f, a and the rank -> id permutations from `task.seed`."""
    rng = np.random.default_rng([task.seed, 100])
    directions = rng.standard_normal((task.num_features, task.planted_dim))
    directions *= task.embedding_scale / np.linalg.norm(directions, axis=1, keepdims=True)
    dense_weights = rng.standard_normal(task.dense_features)
    dense_weights *= task.dense_scale / max(np.linalg.norm(dense_weights), 1e-12)
    permutations = np.stack([rng.permutation(task.rows) for _ in range(task.num_features)])
    weights = np.arange(1, task.rows + 1, dtype=np.float64) ** -task.zipf_exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return PlantedModel(directions, dense_weights, permutations, cdf)


def zipf_ranks(cdf: np.ndarray, size: Any, rng: np.random.Generator) -> np.ndarray:
    """Ranks in [0, len(cdf)) drawn with P(rank r) = cdf[r] - cdf[r - 1] (inverse CDF)."""
    ranks = np.searchsorted(cdf, rng.random(size), side="right")
    return np.minimum(ranks, len(cdf) - 1).astype(np.int64)


def ctr_data(
    task: CtrTask, model: PlantedModel, examples: int, stream: int
) -> Dict[str, np.ndarray]:
    """`examples` examples of the planted task; `stream` picks an independent sample.

    Returns:
      `ids` [examples, num_features] int64, `dense` [examples, dense_features] float32,
      `labels` [examples] float32 in {0, 1}, and `logits` [examples] float64, the planted
      model's logits (the best any model can predict).
    """
    rng = np.random.default_rng([task.seed, 200, stream])
    ranks = zipf_ranks(model.zipf_cdf, (examples, task.num_features), rng)
    ids = np.stack([model.permutations[f][ranks[:, f]] for f in range(task.num_features)], axis=1)
    dense = rng.standard_normal((examples, task.dense_features))
    logits = dense @ model.dense_weights + task.bias
    for f in range(task.num_features):
        logits += planted_vectors(task, f, ids[:, f]) @ model.directions[f]
    labels = (rng.random(examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return {
        "ids": ids.astype(np.int64),
        "dense": dense.astype(np.float32),
        "labels": labels,
        "logits": logits,
    }


def logloss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of `labels` in {0, 1} under sigmoid(`logits`), in nats."""
    y = np.asarray(labels, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    return float(np.mean(np.maximum(z, 0.0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve from ranks (Mann-Whitney U; ties count one half).

    NaN when `labels` has only one class.
    """
    positive = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    num_pos = int(positive.sum())
    num_neg = positive.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # 1-based, ties averaged
    return float((ranks[positive].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


class CtrModel(keras.Model):
    """Embedding bags (one per sparse feature) -> concat with the dense features -> MLP -> logit."""

    def __init__(self, bags: Sequence[keras.layers.Layer], hidden: Sequence[int] = (64, 32)):
        super().__init__()
        self.bags = list(bags)
        self.hidden = [keras.layers.Dense(units, activation="relu") for units in hidden]
        self.head = keras.layers.Dense(1)

    def call(self, ids: tf.Tensor, dense: tf.Tensor) -> tf.Tensor:
        parts = [bag(ids[:, f : f + 1]) for f, bag in enumerate(self.bags)] + [dense]
        x = tf.concat(parts, axis=-1)
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)[:, 0]

    def embedding_variables(self) -> List[Any]:
        """The trainable variables of the embedding bags (tables or TT cores)."""
        return [v for bag in self.bags for v in bag.trainable_variables]


def _resource(variable: Any) -> tf.Variable:
    """The tf.Variable behind a Keras variable (or the variable itself)."""
    return (
        getattr(variable, "value", variable) if isinstance(variable, keras.Variable) else variable
    )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How every model of the comparison is trained (the same for all of them)."""

    steps: int = 1000
    batch: int = 1024
    embedding_lr: float = 0.05  # Adagrad, on tables and TT cores alike
    adagrad_initial: float = 0.0  # initial accumulator (0 as in PyTorch and FBTT)
    adagrad_epsilon: float = 1e-10
    mlp_lr: float = 0.002  # Adam, on the MLP
    eval_batch: int = 16_384


def predict_in_batches(
    predict: Callable[[tf.Tensor, tf.Tensor], tf.Tensor], data: Dict[str, np.ndarray], batch: int
) -> np.ndarray:
    """`predict(ids, dense)` over the examples of `data` (`ctr_data`'s form), `batch` at a
    time, concatenated."""
    return np.concatenate(
        [
            predict(
                tf.constant(data["ids"][i : i + batch]), tf.constant(data["dense"][i : i + batch])
            ).numpy()
            for i in range(0, len(data["labels"]), batch)
        ]
    )


def train_ctr_model(
    model: CtrModel,
    train: Dict[str, np.ndarray],
    test: Dict[str, np.ndarray],
    config: TrainConfig,
    progress: Optional[Callable[[int, float], None]] = None,
) -> Dict[str, Any]:
    """Trains `model` for `config.steps` steps of one pass over `train`; scores `test`.

    Embedding variables get Adagrad (TensorFlow's fused kernels: the sparse one on the rows
    of an `IndexedSlices` gradient, the dense one otherwise), everything else Adam. Each
    step is one `tf.function` call: forward, gradients and all updates.

    Returns:
      `{"logloss", "auc"}` on `test`, `"train_logloss"` (mean over the last 10% of steps),
      `"step_ms"` (median wall time of a step after 5 warm-up steps), `"train_s"` and
      `"embedding_params"`.
    """
    batch = config.batch
    if config.steps * batch > len(train["labels"]):
        raise ValueError(
            f"{config.steps} steps x {batch} examples need {config.steps * batch:,} training "
            f"examples, got {len(train['labels']):,}"
        )
    ids, dense, labels = (tf.constant(train[k][:1]) for k in ("ids", "dense", "labels"))
    model(ids, dense)  # builds the variables
    embedding_vars = model.embedding_variables()
    embedding_keys = {id(v) for v in embedding_vars}
    mlp_vars = [v for v in model.trainable_variables if id(v) not in embedding_keys]
    accumulators = [
        tf.Variable(tf.fill(v.shape, tf.constant(config.adagrad_initial, v.dtype)), trainable=False)
        for v in embedding_vars
    ]
    adam = keras.optimizers.Adam(config.mlp_lr)
    adam.build(mlp_vars)
    lr = tf.constant(config.embedding_lr, tf.float32)
    epsilon = tf.constant(config.adagrad_epsilon, tf.float32)

    ids_spec = tf.TensorSpec([None, train["ids"].shape[1]], tf.int64)
    dense_spec = tf.TensorSpec([None, train["dense"].shape[1]], tf.float32)

    @tf.function(input_signature=[ids_spec, dense_spec, tf.TensorSpec([None], tf.float32)])
    def step(ids: tf.Tensor, dense: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = model(ids, dense, training=True)
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        grads = tape.gradient(loss, embedding_vars + mlp_vars)
        for var, acc, grad in zip(embedding_vars, accumulators, grads[: len(embedding_vars)]):
            if isinstance(grad, tf.IndexedSlices):
                # Rows may repeat (e.g. gathers in a composite lookup): sum them first, so
                # each row takes one Adagrad step on its total gradient.
                rows, position = tf.unique(grad.indices)
                grad = tf.IndexedSlices(
                    tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0]), rows
                )
                tf.raw_ops.ResourceSparseApplyAdagradV2(
                    var=_resource(var).handle,
                    accum=acc.handle,
                    lr=lr,
                    epsilon=epsilon,
                    grad=grad.values,
                    indices=grad.indices,
                )
            else:
                tf.raw_ops.ResourceApplyAdagradV2(
                    var=_resource(var).handle, accum=acc.handle, lr=lr, epsilon=epsilon, grad=grad
                )
        adam.apply(grads[len(embedding_vars) :], mlp_vars)
        return loss

    @tf.function(input_signature=[ids_spec, dense_spec])
    def predict(ids: tf.Tensor, dense: tf.Tensor) -> tf.Tensor:
        return model(ids, dense, training=False)

    times, losses = [], []
    start_all = time.perf_counter()
    for i in range(config.steps):
        part = slice(i * batch, (i + 1) * batch)
        args = (tf.constant(train[k][part]) for k in ("ids", "dense", "labels"))
        start = time.perf_counter()
        loss = float(step(*args))
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss)
        if progress is not None:
            progress(i + 1, loss)
    train_s = time.perf_counter() - start_all

    test_logits = predict_in_batches(predict, test, config.eval_batch)
    tail = losses[-max(1, config.steps // 10) :]
    warm = times[5:] if len(times) > 5 else times
    return {
        "logloss": logloss(test["labels"], test_logits),
        "auc": auc(test["labels"], test_logits),
        "train_logloss": float(np.mean(tail)),
        "step_ms": statistics.median(warm),
        "train_s": train_s,
        "embedding_params": int(sum(int(np.prod(v.shape)) for v in embedding_vars)),
    }


def _tt_layer_class() -> Optional[type]:
    """`tf_ttemb.layers.TTEmbeddingBag` once it exists, else None."""
    return getattr(tf_ttemb.layers, "TTEmbeddingBag", None)


def _tt_implementation() -> str:
    """ "custom_op" when the op library has the TT ops, else "composite" (plain TF ops)."""
    return "custom_op" if hasattr(_loader.load_op_library(), "tf_ttemb_tt_rows") else "composite"


def _bag_factories(
    task: CtrTask, dim: int, ranks: Sequence[int], tt_implementation: str
) -> Dict[str, Tuple[Optional[int], Callable[[], keras.layers.Layer]]]:
    """name -> (TT rank or None, a function making one embedding bag of `task.rows` x `dim`)."""
    factories: Dict[str, Tuple[Optional[int], Callable[[], keras.layers.Layer]]] = {
        "full EmbeddingBag": (None, lambda: tf_ttemb.layers.EmbeddingBag(task.rows, dim)),
    }
    tt_layer = _tt_layer_class()
    if tt_layer is not None:
        for rank in ranks:
            factories[f"TTEmbeddingBag rank {rank}"] = (
                rank,
                functools.partial(tt_layer, task.rows, dim, rank, implementation=tt_implementation),
            )
    return factories


def _ctr_summary_rows(
    results: Dict[str, Dict[str, Any]], ceiling: Dict[str, float], floor: Dict[str, Any]
) -> List[List[str]]:
    full = results.get("full EmbeddingBag", {}).get("embedding_params")
    gap = floor["logloss"] - ceiling["logloss"]
    rows = []
    for name, r in results.items():
        closed = (floor["logloss"] - r["logloss"]) / gap if gap > 0 else float("nan")
        rows.append(
            [
                name,
                f"{r['embedding_params']:,}",
                f"{full / r['embedding_params']:,.1f}x" if full else "n/a",
                f"{r['logloss']:.4f}",
                f"{r['auc']:.4f}",
                f"{100 * closed:.0f}%",
                f"{r['step_ms']:.1f}",
                f"{r['train_s']:.1f}",
            ]
        )
    rows.append(
        [
            "dense features only (no ids)",
            "0",
            "n/a",
            f"{floor['logloss']:.4f}",
            f"{floor['auc']:.4f}",
            "0%",
            f"{floor['step_ms']:.1f}",
            f"{floor['train_s']:.1f}",
        ]
    )
    rows.append(
        [
            "planted model (best possible)",
            "n/a",
            "n/a",
            f"{ceiling['logloss']:.4f}",
            f"{ceiling['auc']:.4f}",
            "100%",
            "n/a",
            "n/a",
        ]
    )
    return rows


def _plot_tt_quality(
    path: str,
    task: CtrTask,
    results: Dict[str, Dict[str, Any]],
    ceiling: Dict[str, float],
    floor: Dict[str, Any],
) -> bool:
    """Held-out AUC and logloss vs compression ratio (log x); False without matplotlib."""

    def draw(all_axes):
        from matplotlib import ticker

        full = results["full EmbeddingBag"]["embedding_params"]
        for axes, key, label in zip(
            all_axes,
            ("auc", "logloss"),
            ("held-out AUC, higher is better", "held-out logloss, lower is better"),
        ):
            tt_points = sorted(
                (full / r["embedding_params"], r[key], r.get("rank"))
                for r in results.values()
                if r.get("rank") is not None
            )
            if tt_points:
                axes.plot(
                    [x for x, _, _ in tt_points],
                    [y for _, y, _ in tt_points],
                    marker="o",
                    label="TTEmbeddingBag",
                )
                for x, y, rank in tt_points:
                    axes.annotate(f"rank {rank}", (x, y), textcoords="offset points", xytext=(4, 6))
            axes.plot(
                [1.0],
                [results["full EmbeddingBag"][key]],
                marker="s",
                linestyle="",
                label="full EmbeddingBag",
            )
            axes.axhline(
                ceiling[key], color="green", linestyle="--", label="planted model (best possible)"
            )
            axes.axhline(floor[key], color="gray", linestyle=":", label="dense features only")
            axes.set_xscale("log")
            axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.4g}x"))
            axes.set_xlabel("compression of the embedding tables (log scale)")
            axes.set_ylabel(label)
            axes.grid(True, which="both", alpha=0.3)
            axes.legend(fontsize="small", loc="best")

    title = (
        f"Planted CTR task: {task.num_features} tables of {task.rows:,} rows, "
        f"Zipf({task.zipf_exponent:g}) ids"
    )
    return _util.save_two_panel_plot(path, title, draw)


def section_tt_quality(args: argparse.Namespace) -> Dict[str, Any]:
    """Full vs TT-compressed tables in a small CTR model: size, quality, step time."""
    task = CtrTask(rows=args.tt_rows, seed=args.seed)
    config = TrainConfig(steps=args.tt_steps, batch=args.tt_batch)
    dim = args.tt_dim
    print(f"A small CTR model on a planted task: {task.describe()}.")
    print(
        f"Model: per sparse feature an embedding bag of {task.rows:,} x {dim} -> concat with the "
        f"dense features -> MLP 64-32-1. Training: {config.steps} steps x {config.batch} "
        f"examples (one pass), Adagrad (lr {config.embedding_lr:g}) on the embeddings, "
        f"Adam (lr {config.mlp_lr:g}) on the MLP."
    )
    _loader.load_op_library()

    planted = planted_model(task)
    train = ctr_data(task, planted, config.steps * config.batch, stream=0)
    test = ctr_data(task, planted, args.tt_test_examples, stream=1)
    ceiling = {
        "logloss": logloss(test["labels"], test["logits"]),
        "auc": auc(test["labels"], test["logits"]),
    }
    print(
        f"Data: {len(train['labels']):,} training and {len(test['labels']):,} held-out "
        f"examples, {100 * train['labels'].mean():.1f}% positive."
    )

    tt_implementation = _tt_implementation()
    factories = _bag_factories(task, dim, args.tt_ranks, tt_implementation)
    if _tt_layer_class() is None:
        print("tf_ttemb.layers.TTEmbeddingBag is not available yet: only the full tables run.")
    else:
        from tf_ttemb import tt

        p, q, _ = tt.resolve_shapes(task.rows, dim, args.tt_ranks[0])
        print(
            f"TT tables: p = {p}, q = {q}, inner ranks [r, r] for r = "
            f"{', '.join(map(str, args.tt_ranks))}"
            f"; lookups through the {tt_implementation} implementation"
            + (
                " (this op library has no TT ops: rebuild with `bash configure.sh` for the "
                "custom op)."
                if tt_implementation == "composite"
                else "."
            )
        )
    results: Dict[str, Dict[str, Any]] = {}
    runs = list(factories.items()) + [("dense features only (no ids)", (None, None))]
    for index, (name, (rank, make_bag)) in enumerate(runs, 1):
        print(f"[{index}/{len(runs)}] {name}")
        keras.utils.set_random_seed(args.seed)
        bags = [] if make_bag is None else [make_bag() for _ in range(task.num_features)]
        model = CtrModel(bags)
        bar = keras.utils.Progbar(config.steps, unit_name="step")
        result = train_ctr_model(
            model, train, test, config, lambda i, loss: bar.update(i, [("loss", loss)])
        )
        result["rank"] = rank
        results[name] = result
        del model, bags
    floor = results.pop("dense features only (no ids)")

    print(f"\nHeld-out quality ({len(test['labels']):,} examples) after {config.steps} steps:")
    headers = [
        "model",
        "embedding params",
        "compression",
        "logloss",
        "AUC",
        "gap closed",
        "ms/step",
        "train s",
    ]
    print(_util.format_table(headers, _ctr_summary_rows(results, ceiling, floor)))
    full = results["full EmbeddingBag"]
    for name, r in results.items():
        if r["rank"] is None:
            continue
        print(
            f"=> {name}: {full['embedding_params'] / r['embedding_params']:,.0f}x fewer "
            f"embedding parameters; AUC {r['auc'] - full['auc']:+.4f} and logloss "
            f"{r['logloss'] - full['logloss']:+.4f} vs the full tables; a training step takes "
            f"{r['step_ms'] / full['step_ms']:.2f}x the full tables' time."
        )
    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    print(
        "gap closed: the share of the logloss gap between the dense-only model and the planted "
        "model that the ids recover. ms/step: median wall time of a training step (forward, "
        f"gradients, optimizer updates; tf.function, {threads} threads) after 5 warm-up steps."
    )

    document = {
        "task": dataclasses.asdict(task),
        "train": dataclasses.asdict(config),
        "embedding_dim": dim,
        "tt_ranks": list(args.tt_ranks),
        "tt_available": _tt_layer_class() is not None,
        "tt_implementation": tt_implementation,
        "train_examples": len(train["labels"]),
        "test_examples": len(test["labels"]),
        "planted_model": ceiling,
        "dense_only": floor,
        "results": results,
    }
    _util.save_results(
        args,
        "tt_quality",
        document,
        lambda path: _plot_tt_quality(path, task, results, ceiling, floor),
    )
    return document
