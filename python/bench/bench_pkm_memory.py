"""Peak memory and time of a Product-Key Memory training step: fused vs materialised.

Run from the checkout after `bash configure.sh`:

  .venv/bin/python python/bench/bench_pkm_memory.py --json bench_results/pkm_memory.json
  .venv/bin/python python/bench/bench_pkm_memory.py --batch 1 --seq 256 --repeats 2   # quicker
  .venv/bin/python python/bench/bench_pkm_memory.py --help

The case is the request that motivated the layer (batch 32 x seq 512 tokens, 4 heads x 32
knn, dim 1024, 512**2 slots) scaled to a 2-core, 24 GiB machine: 4 x 512 tokens by
default; the same arithmetic at the full request shape is printed, not run.

Variants (`--variants`, all by default), the same `tf_ttemb.layers.ProductKeyMemory`
layer (query network with batch norm, product-key top-k, softmax), its memory read and
its values update done four ways; every variant applies the same optimizer
(`--optimizer`, row-wise Adagrad by default) to the values it read:

  fused         `ProductKeyMemory(values_optimizer=...)` on CPU: the memory read is the
                `gather_reduce_sum` custom op and its backward is
                `GatherReduceSumSparseApply`, which updates each slot read in place; the
                gathered [tokens, heads * knn, dim] values and the [U, dim] values
                gradient are never built
  unfused       the custom op read with trainable values (`values_optimizer=None`): the
                deduplicated [U, dim] values gradient is returned, then the update is
                applied to it in TensorFlow ops (the layer before the fused update)
  materialised  `tf.reduce_sum(tf.gather(values, ids) * weights[..., None], axis=-2)`,
                what a user writes without the op, then the same update in TensorFlow
                ops (deduplicating tf.gather's [tokens * heads * knn, dim] gradient): the
                baseline
  composite     `ProductKeyMemory(implementation="composite", values_optimizer=...)`:
                tf_ttemb's chunked plain-TensorFlow read (what runs under XLA), the
                layer's unfused update fallback

One step = forward in training mode (batch statistics) + gradients w.r.t. the input and
every trainable weight (query kernel/bias, batch-norm scale/offset, keys) for a random
upstream gradient + the values update, as a `tf.function` (no XLA). The step returns the
output and those gradients; the values are updated in place.

What is measured, per variant, each in fresh worker processes:

* Peak extra memory of one step: how far the resident set size rises above its level
  with the layer built (the 1 GiB values table, the inputs) and a warm-up step done,
  while the step runs and its outputs and gradients are held: VmHWM, reset through
  /proc/self/clear_refs before the step, in a worker started with
  `MALLOC_MMAP_THRESHOLD_=65536` so that every buffer of 64 KiB or more is returned to
  the OS when freed (the peak is that of live memory). The max over `--memory-steps`
  steps. The same for a forward pass alone (inference mode).
* Time: median (and min) wall-clock time of the step and of the forward pass over
  `--repeats` calls after one warm-up call, in one worker with the default allocator
  settings that holds all the variants' layers and calls them round-robin, so that load
  from other processes (the timings are of a shared machine) affects them alike.
* Held bytes: the step's outputs and gradients (the least any implementation must hold
  when it returns them), and the number U of distinct slots read by the step (the rows
  of the values gradient, where one is built).
* A check that the variants compute the same output and the same change of the values
  table over the steps (inner products with fixed random probes, relative).

Targets (from the issue): peak extra memory of the training step at least 20x lower
with the fused read and update than materialised, and the fused step faster. Printed as
PASS / MISS.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import _bench_util as util
import numpy as np

VARIANTS: Dict[str, str] = {
    "fused": "PKM, values update fused in the op",
    "unfused": "PKM op, values gradient, then update",
    "materialised": "PKM + tf.gather * w, reduce_sum, update",
    "composite": "PKM composite (XLA fallback), update",
}
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")
LEARNING_RATE = 0.05
BASELINE = "materialised"
MEMORY_TARGET = 20.0  # materialised peak / fused peak
AGREEMENT_TOLERANCE = 1e-4
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A PKM layer and a batch of tokens."""

    batch: int
    seq: int
    dim: int
    n_keys: int
    k_dim: int
    heads: int
    knn: int
    seed: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def slots(self) -> int:
        return self.n_keys**2

    @property
    def bag(self) -> int:
        return self.heads * self.knn

    def describe(self) -> str:
        return (
            f"{self.batch} x {self.seq} tokens, d_in = output dim = {self.dim}, "
            f"{self.heads} heads x {self.knn} knn, k_dim {self.k_dim}, "
            f"{self.n_keys}^2 = {self.slots:,} slots (values table "
            f"{self.slots * self.dim * 4 / GIB:.2f} GiB float32)"
        )


def arithmetic(shape: Shape) -> Dict[str, int]:
    """Bytes of the tensors that decide the memory of the two ways to read the memory."""
    f32 = 4
    gathered = shape.tokens * shape.bag * shape.dim * f32
    return {
        "tokens": shape.tokens,
        "gathered_bytes": gathered,  # [tokens, heads * knn, dim], forward
        "gathered_grad_bytes": gathered,  # tf.gather's IndexedSlices values, backward
        "output_bytes": shape.tokens * shape.dim * f32,
        "values_table_bytes": shape.slots * shape.dim * f32,
        # Deduplicated values gradient: at most one row per slot, at most one per read.
        "fused_values_grad_max_bytes": min(shape.slots, shape.tokens * shape.bag) * shape.dim * f32,
    }


# ----------------------------------------------------------------------------------------
# Worker.


def _layer(shape: Shape, variant: str, optimizer: str) -> tuple:
    """The variant's layer and, where the step applies the update, (variable, state)."""
    import keras
    import tensorflow as tf

    util.add_checkout_to_path()
    from tf_ttemb.layers import ProductKeyMemory

    class MaterialisedProductKeyMemory(ProductKeyMemory):
        """The same layer with the memory read users write without a fused op."""

        def _read_memory(self, ids, weights, padding_id, update_values=False):
            # gather on the tf.Variable itself: a ResourceGather reads the rows in place
            # (converting the Keras variable to a tensor first would copy the whole
            # table on every read once sparse updates put it in copy-on-read mode).
            gathered = tf.gather(self.values.value, ids)  # [tokens, heads * knn, dim]
            return tf.reduce_sum(gathered * tf.cast(weights, gathered.dtype)[..., None], axis=-2)

    keras.utils.set_random_seed(shape.seed)
    kwargs = dict(n_keys=shape.n_keys, k_dim=shape.k_dim, heads=shape.heads, knn=shape.knn)
    fused = dict(values_optimizer=optimizer, values_learning_rate=LEARNING_RATE)
    if variant == "fused":
        layer = ProductKeyMemory(**fused, **kwargs)
    elif variant == "composite":
        layer = ProductKeyMemory(implementation="composite", **fused, **kwargs)
    elif variant == "unfused":
        layer = ProductKeyMemory(**kwargs)
    elif variant == "materialised":
        layer = MaterialisedProductKeyMemory(**kwargs)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    layer.build((None, shape.dim))
    if variant == "fused":
        assert layer._fused_values_update(), "the fused update is not taken (GPU visible?)"
    update = None
    if variant in ("unfused", "materialised"):
        state = None
        if optimizer != "sgd":
            rows = (shape.slots,) if optimizer == "rowwise_adagrad" else (shape.slots, shape.dim)
            state = tf.Variable(tf.zeros(rows))
        update = (layer.values.value, state)
    return layer, update


def _held_bytes(tf: Any, tensors: Sequence[Any]) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            total += t.values.shape.num_elements() * t.values.dtype.size
            total += t.indices.shape.num_elements() * t.indices.dtype.size
        else:
            total += t.shape.num_elements() * t.dtype.size
    return total


def worker_main(spec: Dict[str, Any]) -> None:
    result: Dict[str, Any]
    try:
        result = _worker(spec)
    except Exception as e:  # reported to the driver, which prints it
        import traceback

        result = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    util.write_worker_result(spec, result)


def _step_functions(tf: Any, layer: Any, update: Any, optimizer: str) -> tuple:
    """`step(x, upstream)` (training forward + gradients + values update), `forward(x)`.

    `update`: None when the layer updates its values itself (values_optimizer), else
    (values variable, optimizer state) to which the step applies the same optimizer.
    The step returns the output and every gradient but the values'.
    """
    from tf_ttemb.layers.product_key_memory import _apply_values_update

    variables = layer.trainable_variables

    @tf.function
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            output = layer(x, training=True)
        grads = tape.gradient(output, [x] + variables, output_gradients=upstream)
        kept = []
        updates = []
        for variable, grad in zip(variables, grads[1:]):
            if update is not None and variable.name == "values":
                updates += _apply_values_update(
                    update[0], update[1], grad, optimizer, LEARNING_RATE, 1e-7
                )
            else:
                kept.append(grad)
        with tf.control_dependencies(updates):
            return [tf.identity(output), tf.identity(grads[0])] + kept

    @tf.function
    def forward(x):
        return layer(x, training=False)

    names = ["output", "inputs"] + [v.name for v in variables if v.name != "values"]
    return step, forward, names


def _inputs(tf: Any, shape: Shape) -> tuple:
    rng = np.random.default_rng([shape.seed, 1])
    size = (shape.batch, shape.seq, shape.dim)
    x = tf.constant(rng.standard_normal(size, np.float32))
    upstream = tf.constant(rng.standard_normal(size, np.float32))
    return x, upstream


def _time_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Times every variant in one process, round-robin, so load changes hit all alike."""
    import time

    import tensorflow as tf

    shape = Shape(**spec["shape"])
    x, upstream = _inputs(tf, shape)
    calls = {}
    for variant in spec["variants"]:
        layer, update = _layer(shape, variant, spec["optimizer"])
        step, forward, _ = _step_functions(tf, layer, update, spec["optimizer"])
        step(x, upstream)  # warm-up: tracing, first-run allocations
        forward(x)
        calls[variant] = {"step": lambda s=step: s(x, upstream), "forward": lambda f=forward: f(x)}
    samples = {v: {"step": [], "forward": []} for v in calls}
    for _ in range(spec["repeats"]):
        for kind in ("step", "forward"):
            for variant, fns in calls.items():
                start = time.perf_counter()
                fns[kind]()
                samples[variant][kind].append((time.perf_counter() - start) * 1e3)
    timings = {
        variant: {
            kind: {
                "median_ms": float(np.median(values)),
                "min_ms": float(np.min(values)),
                "repeats": len(values),
            }
            for kind, values in kinds.items()
        }
        for variant, kinds in samples.items()
    }
    return {"ok": True, "timings": timings}


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    if spec["mode"] == "time":
        return _time_worker(spec)
    import tensorflow as tf

    shape = Shape(**spec["shape"])
    layer, update = _layer(shape, spec["variant"], spec["optimizer"])
    x, upstream = _inputs(tf, shape)
    step, forward, names = _step_functions(tf, layer, update, spec["optimizer"])
    before = _table_probe(tf, shape, layer.values)

    # Memory: warm up (tracing, thread pools, first-run allocations), then measure.
    step(x, upstream)
    forward(x)
    meter = util.PeakRss()
    step_growth = []
    held = output_print = None
    for _ in range(spec["memory_steps"]):
        meter.start()
        outputs = step(x, upstream)
        step_growth.append(meter.growth_bytes())
        held = {name: _held_bytes(tf, [t]) for name, t in zip(names, outputs)}
        output_print = _output_probe(tf, shape, outputs[0])
        del outputs
    # Slots read by one step: the rows of the values gradient where one is built.
    ids, _ = layer.lookup(x, training=True)
    values_rows = int(tf.size(tf.unique(tf.reshape(ids, [-1])).y))
    after = _table_probe(tf, shape, layer.values)
    checks = {
        "output": output_print,
        "values_change": [after[0] - before[0], abs(after[0] - before[0])],
    }
    meter.start()
    output = forward(x)
    forward_growth = meter.growth_bytes()
    del output
    return {
        "ok": True,
        "rss_method": meter.method,
        "step_growth_bytes": max(step_growth),
        "step_growth_all_bytes": step_growth,
        "forward_growth_bytes": forward_growth,
        "held_bytes": held,
        "held_total_bytes": sum(held.values()),
        "values_grad_rows": values_rows,
        "fingerprints": checks,
        "versions": {"tensorflow": tf.__version__, "numpy": np.__version__},
    }


def _output_probe(tf: Any, shape: Shape, output: Any) -> list:
    """[inner product of the output with a fixed random probe, its norm bound]."""
    rng = np.random.default_rng([shape.seed, 2])
    out_probe = tf.constant(rng.standard_normal((shape.tokens, shape.dim)))
    out = tf.reshape(tf.cast(output, tf.float64), [shape.tokens, shape.dim])
    return [float(tf.reduce_sum(out * out_probe)), float(tf.norm(out) * tf.norm(out_probe))]


def _table_probe(tf: Any, shape: Shape, values: Any) -> list:
    """The values table's inner product with a fixed random rank-one probe, in float64.

    Linear in the table, so the difference of two probes is the probe of the change;
    computed in row chunks (no float64 copy of the whole table).
    """
    rng = np.random.default_rng([shape.seed, 3])
    row_probe = rng.standard_normal(shape.slots)
    col_probe = tf.constant(rng.standard_normal(shape.dim))
    total = 0.0
    chunk = 16384
    for start in range(0, shape.slots, chunk):
        # sparse_read: a gather in place (a slice would copy the whole table once the
        # variable is in copy-on-read mode).
        rows = tf.cast(
            values.value.sparse_read(tf.range(start, min(start + chunk, shape.slots))), tf.float64
        )
        projected = tf.linalg.matvec(rows, col_probe).numpy()
        total += float(np.dot(projected, row_probe[start : start + chunk]))
    return [total, 0.0]


# ----------------------------------------------------------------------------------------
# Driver.


def measure(args: argparse.Namespace, shape: Shape) -> Dict[str, Dict[str, Any]]:
    script = os.path.abspath(__file__)
    results: Dict[str, Dict[str, Any]] = {}
    base = {
        "shape": dataclasses.asdict(shape),
        "repeats": args.repeats,
        "memory_steps": args.memory_steps,
        "optimizer": args.optimizer,
    }
    for i, variant in enumerate(args.variants, 1):
        label = f"[{i}/{len(args.variants)}] {VARIANTS[variant]}"
        util.log(f"{label}: peak memory ...")
        memory = util.run_worker(
            script,
            dict(base, variant=variant, mode="memory"),
            {"MALLOC_MMAP_THRESHOLD_": "65536", "TF_CPU_ALLOCATOR_USE_BFC": None},
        )
        results[variant] = memory
        if not memory.get("ok"):
            util.log(f"{label}: failed\n{memory.get('error')}")
    timed = [v for v in args.variants if results[v].get("ok")]
    util.log(f"time: {', '.join(timed)}, round-robin in one process ...")
    timing = util.run_worker(
        script,
        dict(base, variants=timed, mode="time"),
        {"MALLOC_MMAP_THRESHOLD_": None, "TF_CPU_ALLOCATOR_USE_BFC": None},
    )
    for variant in timed:
        if timing.get("ok"):
            results[variant]["time"] = timing["timings"][variant]
        else:
            results[variant] = dict(results[variant], ok=False, error=timing.get("error"))
    if not timing.get("ok"):
        util.log(f"timing failed\n{timing.get('error')}")
    return results


def _agreement(results: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """Worst relative probe difference of each variant from the baseline."""
    base = results.get(BASELINE, {}).get("fingerprints")
    worst: Dict[str, Optional[float]] = {}
    for variant, result in results.items():
        prints = result.get("fingerprints")
        if not base or not prints:
            worst[variant] = None
            continue
        worst[variant] = max(abs(prints[k][0] - base[k][0]) / max(base[k][1], 1e-300) for k in base)
    return worst


def _ms(timing: Optional[Dict[str, Any]]) -> str:
    return "-" if not timing else f"{timing['median_ms']:,.0f} ({timing['min_ms']:,.0f})"


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def report(
    shape: Shape,
    full: Shape,
    results: Dict[str, Dict[str, Any]],
    load: Dict[str, Any],
    optimizer: str,
) -> tuple[str, Dict[str, Any]]:
    lines = [f"PKM memory benchmark: {shape.describe()}", ""]
    agreement = _agreement(results)
    base = results.get(BASELINE, {})
    headers = [
        "variant",
        "step peak MiB",
        "fwd peak MiB",
        "held MiB",
        "U",
        "step ms (min)",
        "fwd ms (min)",
        "vs materialised",
        "agreement",
    ]
    rows = []
    for variant, result in results.items():
        if not result.get("ok"):
            rows.append([VARIANTS[variant], "failed"] + ["-"] * (len(headers) - 2))
            continue
        ratio = "-"
        if base.get("ok") and result["step_growth_bytes"]:
            ratio = (
                f"{base['step_growth_bytes'] / result['step_growth_bytes']:.1f}x mem, "
                f"{base['time']['step']['median_ms'] / result['time']['step']['median_ms']:.1f}x"
                " time"
            )
        rows.append(
            [
                VARIANTS[variant],
                util.mib_text(result["step_growth_bytes"]),
                util.mib_text(result["forward_growth_bytes"]),
                util.mib_text(result["held_total_bytes"]),
                f"{result['values_grad_rows']:,}",
                _ms(result["time"]["step"]),
                _ms(result["time"]["forward"]),
                ratio,
                "-" if agreement[variant] is None else f"{agreement[variant]:.1e}",
            ]
        )
    lines.append(util.format_table(headers, rows))
    method = next((r["rss_method"] for r in results.values() if r.get("ok")), "-")
    lines += [
        "",
        f"peak = growth of the resident set size over one step above the level with the layer "
        f"built ({method}); held = the step's outputs and gradients; U = distinct slots read "
        f"(rows of the values gradient where one is built); times are medians (min) of the "
        f"step as a tf.function; load average "
        f"{load['before']} before, {load['after']} after ({util.usable_cpus()} usable CPUs).",
    ]

    verdicts: Dict[str, Any] = {}
    fused = results.get("fused", {})
    if fused.get("ok") and base.get("ok"):
        mem_ratio = base["step_growth_bytes"] / max(fused["step_growth_bytes"], 1)
        fwd_ratio = base["forward_growth_bytes"] / max(fused["forward_growth_bytes"], 1)
        work_fused = max(fused["step_growth_bytes"] - fused["held_total_bytes"], 0)
        work_base = max(base["step_growth_bytes"] - base["held_total_bytes"], 0)
        speed = base["time"]["step"]["median_ms"] / fused["time"]["step"]["median_ms"]
        verdicts = {
            "optimizer": optimizer,
            "memory_ratio": mem_ratio,
            "memory_target": MEMORY_TARGET,
            "memory_pass": mem_ratio >= MEMORY_TARGET,
            "speedup": speed,
            "speed_pass": speed > 1.0,
            "forward_memory_ratio": fwd_ratio,
            "working_memory_bytes": {"fused": work_fused, "materialised": work_base},
            "working_memory_ratio": work_base / max(work_fused, 1),
            "ratio_bound_if_only_held": base["step_growth_bytes"] / fused["held_total_bytes"],
            "values_gradient_bytes_not_built": fused["values_grad_rows"] * shape.dim * 4,
        }
        unfused = results.get("unfused", {})
        if unfused.get("ok"):
            verdicts["unfused_memory_ratio"] = base["step_growth_bytes"] / max(
                unfused["step_growth_bytes"], 1
            )
        lines += [
            "",
            f"{'PASS' if verdicts['memory_pass'] else 'MISS'}: training step ({optimizer} on the "
            f"values) peak extra memory {util.mib_text(fused['step_growth_bytes'])} MiB fused vs "
            f"{util.mib_text(base['step_growth_bytes'])} MiB materialised = {mem_ratio:.1f}x lower "
            f"(target >= {MEMORY_TARGET:.0f}x)",
            f"{'PASS' if verdicts['speed_pass'] else 'MISS'}: step time "
            f"{fused['time']['step']['median_ms']:,.0f} ms fused vs "
            f"{base['time']['step']['median_ms']:,.0f} ms materialised = {speed:.1f}x faster",
            f"  forward alone (inference): {util.mib_text(fused['forward_growth_bytes'])} vs "
            f"{util.mib_text(base['forward_growth_bytes'])} MiB = {fwd_ratio:.1f}x lower",
            f"  the fused step never builds the values gradient ({fused['values_grad_rows']:,} "
            f"distinct slots x {shape.dim} x 4 B = "
            f"{util.mib_text(verdicts['values_gradient_bytes_not_built'])} MiB); "
            f"beyond what it returns it needs {util.mib_text(work_fused)} MiB "
            f"(materialised: {util.mib_text(work_base)} MiB)",
        ]
        if unfused.get("ok"):
            lines.append(
                f"  unfused (the op's values gradient, then the update): "
                f"{util.mib_text(unfused['step_growth_bytes'])} MiB = "
                f"{verdicts['unfused_memory_ratio']:.1f}x lower than materialised"
            )

    scaled_math, full_math = arithmetic(shape), arithmetic(full)
    lines += ["", "Arithmetic (float32 bytes, not measured):"]
    for label, s, a in (("scaled (run)", shape, scaled_math), ("full request", full, full_math)):
        lines.append(
            f"  {label}: {s.batch} x {s.seq} = {a['tokens']:,} tokens: gathered "
            f"[{a['tokens']:,}, {s.bag}, {s.dim}] = {a['gathered_bytes'] / GIB:,.2f} GiB "
            f"(+ the same again for its gradient) vs output [{a['tokens']:,}, {s.dim}] = "
            f"{util.mib_text(a['output_bytes'])} MiB; a values gradient (not built when fused) <= "
            f"{util.mib_text(a['fused_values_grad_max_bytes'])} MiB (values table "
            f"{util.mib_text(a['values_table_bytes'])} MiB)"
        )
    document = {
        "benchmark": "pkm_memory",
        "machine": util.machine_info(),
        "load_average": load,
        "shape": dataclasses.asdict(shape),
        "full_request_shape": dataclasses.asdict(full),
        "arithmetic": {"scaled": scaled_math, "full_request": full_math},
        "results": results,
        "agreement": agreement,
        "verdicts": verdicts,
    }
    return "\n".join(lines), document


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    util.add_int_options(
        parser,
        batch=(4, "sequences (default: 4)"),
        seq=(512, "tokens each (default: 512)"),
        full_batch=(32, "batch of the request's shape, arithmetic only (default: 32)"),
        dim=(1024, "input and value size (default: 1024)"),
        n_keys=(512, "default: 512"),
        k_dim=(256, "default: 256"),
        heads=(4, "default: 4"),
        knn=(32, "default: 32"),
        repeats=(5, "timed calls per variant (default: 5)"),
        memory_steps=(2, "measured steps per variant, max reported (default: 2)"),
    )
    util.add_choice_list(
        parser,
        "--variants",
        VARIANTS,
        f"comma-separated, from {', '.join(VARIANTS)} (default: all)",
        default=list(VARIANTS),
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="rowwise_adagrad",
        help="the values optimizer of every variant (default: rowwise_adagrad)",
    )
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    parser.add_argument("--json", help="write the results to this JSON file")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    shape = util.from_options(Shape, args)
    full = dataclasses.replace(shape, batch=args.full_batch)
    util.log(f"PKM memory benchmark: {shape.describe()}")
    load = {"before": _loadavg()}
    results = measure(args, shape)
    load["after"] = _loadavg()
    text, document = report(shape, full, results, load, args.optimizer)
    print(text)
    if args.json:
        document["settings"] = dict(
            util.option_values(args, "repeats", "memory_steps", "variants", "optimizer"),
            learning_rate=LEARNING_RATE,
        )
        util.write_json(args.json, document)
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(util.main_or_worker(main, worker_main))
