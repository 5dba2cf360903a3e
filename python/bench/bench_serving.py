"""Benchmarks `tf_ttemb.export_for_serving`: accuracy and size of quantised tables, latency.

Run from the checkout after `bash configure.sh`:

  .venv/bin/python python/bench/bench_serving.py                 # ~3 min on 2 busy cores
  .venv/bin/python python/bench/bench_serving.py --quick         # 100,000-row tables, ~1 min
  .venv/bin/python python/bench/bench_serving.py --json out.json --rows 1000000 --steps 1000

Two sections:

* Quality (`--sections quality`): the demo's planted CTR task (`tf_ttemb.demo`,
  section `tt_quality`: 3 sparse features over tables of `--rows` ids, 4 dense features,
  an MLP) trained with full `EmbeddingBag` tables exactly as the demo trains it
  (`train_ctr_model`: Adagrad on the tables, Adam on the MLP, `--steps` x 1,024
  examples), then exported with `quantize=None`, `"float16"` and `"int8"`. Each export
  is loaded with `tf.saved_model.load` and scored on the demo's 100,000 held-out
  examples through its `serving_default` signature: held-out AUC and logloss, the
  largest logit difference from the custom-op model, the bytes of the exported tables
  (`ServingExport.table_nbytes`) and of the SavedModel directory.
* Latency (`--sections latency`): median wall time of one call, per batch of 1 and of
  1,024 examples, of the custom-op model (the Keras model in a `tf.function`,
  `training=False`) against each exported path's `serving_default` signature (the
  function TF Serving runs), in this process (the exported graph holds stock ops only;
  which process runs it does not matter). Models: the CTR model with full tables
  (float32, float16, int8), the same model with `TTEmbeddingBag` tables of rank 16
  (untrained; exported as TT rows and decompressed to dense), and a
  `ProductKeyMemory` model (one token of 64 features per example, n_keys 128, 4 heads x
  32 slots, values 16,384 x 64; float32 and int8 values). Times: median over
  `--repeats-1` calls (batch 1) or `--repeats-1024` calls (batch 1,024) after 5 warm-up
  calls, each on the same batch; the CPU is shared, so only same-run ratios mean much.

Prints a table per section and writes everything to `--json` (default
`bench_serving.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tf_ttemb
from tf_ttemb.demo import tt_quality as demo

SECTIONS = ("quality", "latency")
QUANTIZE = (None, "float16", "int8")
BATCHES = (1, 1024)


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def _ctr_specs(task: demo.CtrTask) -> list[tf.TensorSpec]:
    return [
        tf.TensorSpec([None, task.num_features], tf.int64, name="ids"),
        tf.TensorSpec([None, task.dense_features], tf.float32, name="dense"),
    ]


def _ctr_model(task: demo.CtrTask, make_bag: Callable[[], keras.layers.Layer]):
    model = demo.CtrModel([make_bag() for _ in range(task.num_features)])
    model(tf.zeros([1, task.num_features], tf.int64), tf.zeros([1, task.dense_features]))
    return model


def _export(model, directory: str, name: str, **kwargs) -> dict[str, Any]:
    path = os.path.join(directory, name)
    start = time.perf_counter()
    export = tf_ttemb.export_for_serving(model, path, **kwargs)
    seconds = time.perf_counter() - start
    loaded = tf.saved_model.load(path)
    return {
        "name": name,
        "path": path,
        "export_s": seconds,
        "tables": [t.kind for t in export.tables],
        "table_bytes": export.table_nbytes,
        "saved_model_bytes": _dir_bytes(path),
        "signature": loaded.signatures["serving_default"],
        "output": export.outputs[0],
        "loaded": loaded,
    }


def _score(signature, output: str, data: dict[str, np.ndarray], batch: int) -> np.ndarray:
    parts = []
    for i in range(0, len(data["labels"]), batch):
        out = signature(
            ids=tf.constant(data["ids"][i : i + batch]),
            dense=tf.constant(data["dense"][i : i + batch]),
        )
        parts.append(out[output].numpy().reshape(-1))
    return np.concatenate(parts)


def section_quality(args, directory: str) -> dict[str, Any]:
    task = demo.CtrTask(rows=args.rows, seed=args.seed)
    config = demo.TrainConfig(steps=args.steps)
    _bench_util.log(f"quality: {task.describe()}; training {config.steps} steps x {config.batch}")
    planted = demo.planted_model(task)
    train = demo.ctr_data(task, planted, config.steps * config.batch, stream=0)
    test = demo.ctr_data(task, planted, args.test_examples, stream=1)
    keras.utils.set_random_seed(args.seed)
    model = _ctr_model(task, lambda: tf_ttemb.layers.EmbeddingBag(task.rows, args.dim))
    trained = demo.train_ctr_model(model, train, test, config)
    predict = tf.function(lambda ids, dense: model(ids, dense, training=False))
    custom = demo.predict_in_batches(predict, test, config.eval_batch)
    rows = [
        {
            "path": "custom-op model (Keras)",
            "table_bytes": task.num_features * task.rows * args.dim * 4,
            "saved_model_bytes": None,
            "auc": demo.auc(test["labels"], custom),
            "logloss": demo.logloss(test["labels"], custom),
            "max_logit_diff": 0.0,
        }
    ]
    exports = {}
    for mode in QUANTIZE:
        name = f"ctr_{mode or 'float32'}"
        _bench_util.log(f"quality: exporting {name}")
        exported = _export(
            model, directory, name, input_specs=_ctr_specs(task), forms=["dense"], quantize=mode
        )
        logits = _score(exported["signature"], exported["output"], test, config.eval_batch)
        rows.append(
            {
                "path": f"served, tables {mode or 'float32'}",
                "table_bytes": exported["table_bytes"],
                "saved_model_bytes": exported["saved_model_bytes"],
                "auc": demo.auc(test["labels"], logits),
                "logloss": demo.logloss(test["labels"], logits),
                "max_logit_diff": float(np.abs(logits - custom).max()),
                "export_s": exported["export_s"],
            }
        )
        exports[mode or "float32"] = exported
    return {
        "task": task.describe(),
        "rows": args.rows,
        "dim": args.dim,
        "steps": config.steps,
        "test_examples": args.test_examples,
        "training": {k: v for k, v in trained.items() if k != "embedding_params"},
        "results": rows,
        "_model": model,
        "_exports": exports,
    }


def _time(fn: Callable[[], Any], batch: int, args) -> float:
    repeats = args.repeats_1 if batch == 1 else args.repeats_1024
    return _bench_util.time_calls(fn, warmup=5, repeats=repeats).median_ms


def _latency_rows(label: str, custom: Callable, exports: list[dict[str, Any]], feeds, args):
    rows = []
    for batch in BATCHES:
        inputs = feeds(batch)
        rows.append(
            {
                "model": label,
                "path": "custom op (Keras model)",
                "batch": batch,
                "ms": _time(lambda i=inputs: custom(**i), batch, args),
            }
        )
        for exported in exports:
            signature = exported["signature"]
            rows.append(
                {
                    "model": label,
                    "path": f"served: {exported['name']}",
                    "batch": batch,
                    "ms": _time(lambda s=signature, i=inputs: s(**i), batch, args),
                    "tables": exported["tables"],
                }
            )
    return rows


def section_latency(args, directory: str, quality: dict[str, Any] | None) -> dict[str, Any]:
    task = demo.CtrTask(rows=args.rows, seed=args.seed)
    rng = np.random.default_rng(args.seed)

    def ctr_feeds(batch):
        return {
            "ids": tf.constant(rng.integers(0, task.rows, size=(batch, task.num_features))),
            "dense": tf.constant(rng.normal(size=(batch, task.dense_features)), tf.float32),
        }

    rows = []
    if quality is not None:
        model, exports = quality["_model"], list(quality["_exports"].values())
    else:
        keras.utils.set_random_seed(args.seed)
        model = _ctr_model(task, lambda: tf_ttemb.layers.EmbeddingBag(task.rows, args.dim))
        exports = [
            _export(
                model,
                directory,
                f"ctr_{m or 'float32'}",
                input_specs=_ctr_specs(task),
                forms=["dense"],
                quantize=m,
            )
            for m in QUANTIZE
        ]
    specs = _ctr_specs(task)
    custom = tf.function(
        lambda ids, dense: model(ids, dense, training=False), input_signature=specs
    )
    _bench_util.log("latency: CTR model, full tables")
    rows += _latency_rows("CTR, EmbeddingBag tables", custom, exports, ctr_feeds, args)

    keras.utils.set_random_seed(args.seed)
    tt_model = _ctr_model(task, lambda: tf_ttemb.layers.TTEmbeddingBag(task.rows, args.dim, 16))
    tt_exports = [
        _export(
            tt_model,
            directory,
            "ctr_tt_rows",
            input_specs=specs,
            forms=["dense"],
            tt_dense_max_mib=0,
        ),
        _export(
            tt_model,
            directory,
            "ctr_tt_dense",
            input_specs=specs,
            forms=["dense"],
            tt_dense_max_mib=float("inf"),
        ),
    ]
    tt_custom = tf.function(
        lambda ids, dense: tt_model(ids, dense, training=False), input_signature=specs
    )
    _bench_util.log("latency: CTR model, TT tables rank 16")
    rows += _latency_rows("CTR, TTEmbeddingBag rank 16", tt_custom, tt_exports, ctr_feeds, args)

    keras.utils.set_random_seed(args.seed)
    x = keras.Input(shape=(64,), name="x")
    pkm = tf_ttemb.layers.ProductKeyMemory(n_keys=128, k_dim=64, heads=4, knn=32)
    pkm_model = keras.Model(x, keras.layers.Dense(1, name="score")(pkm(x)))
    pkm_model(tf.random.normal([256, 64]), training=True)  # batch-norm statistics
    pkm_exports = [
        _export(pkm_model, directory, f"pkm_{m or 'float32'}", quantize=m) for m in (None, "int8")
    ]
    pkm_custom = tf.function(
        lambda x: pkm_model(x, training=False),
        input_signature=[tf.TensorSpec([None, 64], tf.float32)],
    )

    def pkm_feeds(batch):
        return {"x": tf.constant(rng.normal(size=(batch, 64)), tf.float32)}

    _bench_util.log("latency: PKM model")
    rows += _latency_rows("ProductKeyMemory 16,384 x 64", pkm_custom, pkm_exports, pkm_feeds, args)
    sizes = {
        e["name"]: {
            "table_bytes": e["table_bytes"],
            "saved_model_bytes": e["saved_model_bytes"],
            "tables": e["tables"],
        }
        for e in exports + tt_exports + pkm_exports
    }
    return {"results": rows, "exports": sizes}


def _print_quality(result: dict[str, Any]) -> None:
    print(
        f"\nQuality: {result['task']}; {result['steps']} training steps; "
        f"{result['test_examples']:,} held-out examples"
    )
    headers = ["path", "tables MiB", "SavedModel MiB", "AUC", "logloss", "max |logit diff|"]
    table = [
        [
            r["path"],
            f"{r['table_bytes'] / _bench_util.MIB:.1f}",
            "-"
            if r["saved_model_bytes"] is None
            else f"{r['saved_model_bytes'] / _bench_util.MIB:.1f}",
            f"{r['auc']:.5f}",
            f"{r['logloss']:.4f}",
            f"{r['max_logit_diff']:.2g}",
        ]
        for r in result["results"]
    ]
    print(_bench_util.format_table(headers, table))


def _print_latency(result: dict[str, Any]) -> None:
    print("\nLatency per call (median ms), CPU")
    by_key: dict[tuple, dict[int, float]] = {}
    for r in result["results"]:
        by_key.setdefault((r["model"], r["path"]), {})[r["batch"]] = r["ms"]
    headers = ["model / path"] + [f"batch {b:,}" for b in BATCHES]
    table = [
        [f"{model} / {path}"] + [f"{times[b]:.3f}" for b in BATCHES]
        for (model, path), times in by_key.items()
    ]
    print(_bench_util.format_table(headers, table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sections", type=lambda s: _bench_util.parse_list(s, SECTIONS), default=list(SECTIONS)
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of each table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000, help="training steps (quality)")
    parser.add_argument("--test-examples", type=int, default=100_000)
    parser.add_argument("--repeats-1", type=int, default=200)
    parser.add_argument("--repeats-1024", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="100,000-row tables, 300 steps, 20,000 held-out examples",
    )
    parser.add_argument("--json", default="bench_serving.json")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps, args.test_examples = 100_000, 300, 20_000
        args.repeats_1, args.repeats_1024 = 100, 15
    output: dict[str, Any] = {
        "machine": _bench_util.machine_info(),
        "tensorflow": tf.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "sections"},
    }
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as directory:
        quality = None
        if "quality" in args.sections:
            quality = section_quality(args, directory)
            _print_quality(quality)
            output["quality"] = {k: v for k, v in quality.items() if not k.startswith("_")}
        if "latency" in args.sections:
            latency = section_latency(args, directory, quality)
            _print_latency(latency)
            output["latency"] = latency
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(output, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
