"""The demo's `pkm_lm` section: a byte-level language model without and with a PKM layer.

The text is real and written by nobody here: the Python standard library's own source,
as shipped with the interpreter that runs the demo (so the numbers depend on the Python
version, which the section prints).

* Corpus: every `*.py` file directly in `sysconfig.get_paths()["stdlib"]` (no packages,
  so no `site-packages`, no test suites), in sorted name order, read as bytes. A file goes
  to validation when `zlib.crc32(name) % 10 == 0` (about a tenth of the files), to
  training otherwise; each split is its files' bytes concatenated in that order. The split
  depends only on the file names, so it is the same on every machine and run.
* Training batches: windows of `context + 1` bytes at uniform random offsets of the
  training bytes, drawn from a generator seeded by (seed, step), so every model sees the
  same batches in the same order.
* Validation: a fixed subset, `count` windows at evenly spaced offsets of the validation
  bytes; bits per byte = the mean cross-entropy over every predicted byte of those
  windows (each window predicts its last `context` bytes from the ones before), in bits.
* Models: a pre-LayerNorm causal transformer over bytes (learned position embeddings,
  GELU feed-forward blocks, untied output layer). The memory model is the same network
  with the feed-forward block of its middle layer replaced by
  `tf_ttemb.layers.ProductKeyMemory`, as in Lample et al. (2019). Both start from the
  same seed and train in lockstep (each step, the same batch for one, then the other, so
  on a shared machine both are timed under the same load), the same number of steps,
  with Adam and one warm-up + cosine schedule; the
  memory's value table (its gradient is a `tf.IndexedSlices` over the slots a batch
  read) gets its own learning rate and `tf_ttemb.optimizers.LazyAdam`, a row-sparse Adam
  like the paper's sparse Adam: only the rows a step read, and their moments, change
  (Keras' Adam would densify the gradient and move every row every step). Unlike
  PyTorch's SparseAdam, its bias correction counts each row's own updates.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import platform
import sysconfig
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

import tf_ttemb
from tf_ttemb.demo import _util

VOCAB = 256  # bytes
VALIDATION_BUCKETS = 10  # a file is a validation file when crc32(name) % 10 == 0
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------
# The corpus.


def stdlib_directory() -> str:
    """Where this interpreter's standard library sources are."""
    return sysconfig.get_paths()["stdlib"]


def corpus_files(directory: str) -> List[str]:
    """The corpus: names of the `*.py` files directly in `directory`, sorted.

    Only the top level: packages (and with them `site-packages` and the test suites) are
    left out.
    """
    return sorted(
        name
        for name in os.listdir(directory)
        if name.endswith(".py") and os.path.isfile(os.path.join(directory, name))
    )


def is_validation_file(name: str) -> bool:
    """Whether file `name` belongs to validation: `crc32(name) % VALIDATION_BUCKETS == 0`."""
    return zlib.crc32(name.encode("utf-8")) % VALIDATION_BUCKETS == 0


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The two splits of the corpus, as byte arrays, and where they came from."""

    directory: str
    python_version: str
    train_files: Tuple[str, ...]
    validation_files: Tuple[str, ...]
    train: np.ndarray  # [train bytes] uint8
    validation: np.ndarray  # [validation bytes] uint8

    def fingerprint(self) -> str:
        """The first 12 hex digits of the SHA-256 of both splits: the same text, the same value."""
        digest = hashlib.sha256(self.train.tobytes())
        digest.update(self.validation.tobytes())
        return digest.hexdigest()[:12]

    def describe(self) -> str:
        """A one-line description for the report."""
        return (
            f"Python {self.python_version} standard library ({self.directory}): the "
            f"{len(self.train_files) + len(self.validation_files)} top-level .py files; "
            f"training {len(self.train_files)} files, {self.train.size:,} bytes; validation "
            f"{len(self.validation_files)} files, {self.validation.size:,} bytes "
            f"(crc32(name) % {VALIDATION_BUCKETS} == 0); fingerprint {self.fingerprint()}"
        )


def _read_files(directory: str, names: Sequence[str]) -> np.ndarray:
    chunks = []
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            chunks.append(f.read())
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_corpus(directory: Optional[str] = None) -> Corpus:
    """Reads and splits the corpus of `directory` (default: this interpreter's stdlib)."""
    directory = directory or stdlib_directory()
    names = corpus_files(directory)
    validation = tuple(name for name in names if is_validation_file(name))
    train = tuple(name for name in names if not is_validation_file(name))
    if not train or not validation:
        raise ValueError(
            f"{directory} has {len(names)} .py files: too few for a training and a validation split"
        )
    return Corpus(
        directory=directory,
        python_version=platform.python_version(),
        train_files=train,
        validation_files=validation,
        train=_read_files(directory, train),
        validation=_read_files(directory, validation),
    )


# ----------------------------------------------------------------------------------------
# Batches and bits per byte.


def _check_length(data: np.ndarray, context: int) -> None:
    if data.size < context + 1:
        raise ValueError(f"windows of {context + 1} bytes need that many bytes, got {data.size}")


def train_windows(data: np.ndarray, batch: int, context: int, seed: int, step: int) -> np.ndarray:
    """The training batch of `step`: [batch, context + 1] bytes at uniform random offsets.

    A pure function of (data, batch, context, seed, step).
    """
    _check_length(data, context)
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, data.size - context, batch)  # last start: size - context - 1
    return data[starts[:, None] + np.arange(context + 1)]


def eval_windows(data: np.ndarray, count: int, context: int) -> np.ndarray:
    """The fixed validation subset: [count, context + 1] bytes at evenly spaced offsets.

    The windows do not overlap when `data` holds at least `count * (context + 1)` bytes.
    """
    _check_length(data, context)
    starts = np.linspace(0, data.size - context - 1, count).round().astype(np.int64)
    return data[starts[:, None] + np.arange(context + 1)]


def window_bits_per_byte(logits: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
    """Mean cross-entropy per window in bits: [..., T, 256] logits, [..., T] ids -> [...]."""
    nats = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.cast(targets, tf.int32), logits=tf.cast(logits, tf.float32)
    )
    return tf.reduce_mean(nats, axis=-1) / LN2


# ----------------------------------------------------------------------------------------
# The models.


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Sizes of the byte-level transformer and of its memory."""

    layers: int = 4
    d_model: int = 128
    heads: int = 4
    context: int = 128
    ffn_mult: int = 4
    memory: bool = False  # the middle layer's feed-forward block is a ProductKeyMemory
    n_keys: int = 128  # n_keys² memory slots
    k_dim: int = 64
    memory_heads: int = 4
    knn: int = 16

    @property
    def memory_layer(self) -> Optional[int]:
        """The index of the block whose feed-forward block is the memory, or None."""
        return self.layers // 2 if self.memory else None

    def describe(self) -> str:
        """A one-line description for the report."""
        text = (
            f"{self.layers} layers, d_model {self.d_model}, {self.heads} attention heads, "
            f"context {self.context}, feed-forward {self.ffn_mult * self.d_model}"
        )
        if self.memory:
            text += (
                f"; layer {self.memory_layer}'s feed-forward block replaced by a "
                f"ProductKeyMemory: {self.n_keys}² = {self.n_keys**2:,} slots x "
                f"{self.d_model}, k_dim {self.k_dim}, {self.memory_heads} heads x knn "
                f"{self.knn}, query batch norm"
            )
        return text


class CausalSelfAttention(keras.layers.Layer):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, d_model: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = keras.layers.Dense(3 * d_model)
        self.out = keras.layers.Dense(d_model)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        batch, length, d_model = tf.shape(x)[0], tf.shape(x)[1], x.shape[-1]
        qkv = tf.reshape(self.qkv(x), [batch, length, 3, self.heads, d_model // self.heads])
        q, k, v = tf.unstack(qkv, axis=2)  # [batch, length, heads, head_dim] each
        scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * (d_model // self.heads) ** -0.5
        causal = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
        scores = tf.where(causal, scores, tf.constant(-1e9, scores.dtype))
        mixed = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores, axis=-1), v)
        return self.out(tf.reshape(mixed, [batch, length, d_model]))


def _memory_layer_class() -> Optional[type]:
    """`tf_ttemb.layers.ProductKeyMemory` once it exists, else None."""
    return getattr(tf_ttemb.layers, "ProductKeyMemory", None)


class Block(keras.layers.Layer):
    """x + attention(LN(x)), then x + feed-forward(LN(x)) (or + memory(LN(x)))."""

    def __init__(self, config: LMConfig, memory: bool, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attention = CausalSelfAttention(config.d_model, config.heads)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.is_memory = memory
        if memory:
            layer = _memory_layer_class()
            if layer is None:
                raise RuntimeError("tf_ttemb.layers.ProductKeyMemory is not available")
            self.feed_forward = layer(
                n_keys=config.n_keys,
                k_dim=config.k_dim,
                heads=config.memory_heads,
                knn=config.knn,
                name="memory",
            )
        else:
            self.feed_forward = keras.Sequential(
                [
                    keras.layers.Dense(config.ffn_mult * config.d_model, activation="gelu"),
                    keras.layers.Dense(config.d_model),
                ]
            )

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x), training=training)


class ByteLM(keras.Model):
    """A causal transformer over bytes: [batch, T] ids in [0, 256) -> [batch, T, 256] logits."""

    def __init__(self, config: LMConfig, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.embed = keras.layers.Embedding(VOCAB, config.d_model)
        self.position = keras.layers.Embedding(config.context, config.d_model)
        self.blocks = [
            Block(config, memory=(i == config.memory_layer), name=f"block_{i}")
            for i in range(config.layers)
        ]
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.head = keras.layers.Dense(VOCAB)

    def _hidden(self, ids: tf.Tensor, upto: int, training: bool) -> tf.Tensor:
        ids = tf.cast(ids, tf.int32)
        x = self.embed(ids) + self.position(tf.range(tf.shape(ids)[1]))
        for block in self.blocks[:upto]:
            x = block(x, training=training)
        return x

    def call(self, ids: tf.Tensor, training: bool = False) -> tf.Tensor:
        x = self._hidden(ids, len(self.blocks), training)
        return self.head(self.norm(x))

    def memory_inputs(self, ids: tf.Tensor) -> tf.Tensor:
        """What the memory reads for `ids` at inference: [batch, T, d_model]."""
        index = self.config.memory_layer
        if index is None:
            raise ValueError("this model has no memory")
        block = self.blocks[index]
        x = self._hidden(ids, index, training=False)
        x = x + block.attention(block.norm1(x))
        return block.norm2(x)

    def memory(self) -> Optional[keras.layers.Layer]:
        """The ProductKeyMemory layer, or None."""
        index = self.config.memory_layer
        return None if index is None else self.blocks[index].feed_forward


def build_model(config: LMConfig, seed: int) -> ByteLM:
    """A `ByteLM` of `config`, initialised from `seed` (the same seed, the same weights)."""
    keras.utils.set_random_seed(seed)  # Keras draws initializer seeds at construction
    model = ByteLM(config)
    model(tf.zeros([1, config.context], tf.int32))  # builds the variables
    return model


def memory_values(model: ByteLM) -> Optional[keras.Variable]:
    """The memory's value table (the variable trained with its own sparse Adam), or None."""
    layer = model.memory()
    if layer is None:
        return None
    values = getattr(layer, "values", None)
    if isinstance(values, keras.Variable):
        return values
    matches = [v for v in layer.trainable_variables if v.path.split("/")[-1] == "values"]
    if len(matches) != 1:
        raise RuntimeError(
            "cannot tell the memory's value table among "
            f"{[v.path for v in layer.trainable_variables]}"
        )
    return matches[0]


def parameter_counts(model: ByteLM) -> Dict[str, int]:
    """Trainable parameters: `total`, `memory_values` and `other` (= total - values)."""
    total = int(sum(int(np.prod(v.shape)) for v in model.trainable_variables))
    values = memory_values(model)
    in_values = 0 if values is None else int(np.prod(values.shape))
    return {"total": total, "memory_values": in_values, "other": total - in_values}


# ----------------------------------------------------------------------------------------
# Training.


class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to `final * peak`."""

    def __init__(self, peak: float, warmup: int, total: int, final: float = 0.1):
        self.peak, self.warmup, self.total, self.final = peak, max(warmup, 1), total, final

    def __call__(self, step: Any) -> tf.Tensor:
        step = tf.cast(step, tf.float32)
        ramp = tf.minimum(1.0, (step + 1.0) / self.warmup)
        progress = tf.clip_by_value(
            (step - self.warmup) / max(self.total - self.warmup, 1), 0.0, 1.0
        )
        decay = self.final + (1.0 - self.final) * 0.5 * (1.0 + tf.cos(math.pi * progress))
        return self.peak * ramp * decay

    def get_config(self) -> Dict[str, Any]:
        return {"peak": self.peak, "warmup": self.warmup, "total": self.total, "final": self.final}


@dataclasses.dataclass(frozen=True)
class LMTrainConfig:
    """How both models are trained and evaluated (the same for both)."""

    steps: int = 200
    batch: int = 16
    lr: float = 2e-3  # Adam, peak of the schedule, everything but the memory values
    values_lr: float = 1e-3  # LazyAdam on the memory values (the paper's 1e-3)
    warmup: int = 40
    eval_every: int = 40
    eval_windows: int = 256
    eval_batch: int = 64
    seed: int = 0


def make_step(
    model: ByteLM, config: LMTrainConfig
) -> Tuple[Callable[[tf.Tensor], tf.Tensor], keras.Optimizer, Optional[keras.Optimizer]]:
    """The training step and its optimizers: Adam, and LazyAdam for the memory values.

    The step is a `tf.function` (forward, gradients, updates) that returns the loss in
    bits per byte. `model` must be built. The second optimizer is None without memory.
    """
    values = memory_values(model)
    dense_vars = [v for v in model.trainable_variables if v is not values]
    adam = keras.optimizers.Adam(WarmupCosine(config.lr, config.warmup, config.steps))
    adam.build(dense_vars)
    sparse = None
    if values is not None:
        sparse = tf_ttemb.optimizers.LazyAdam(
            WarmupCosine(config.values_lr, config.warmup, config.steps)
        )
        sparse.build([values])
    train_vars = dense_vars + ([values] if values is not None else [])

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.uint8)])
    def step(window: tf.Tensor) -> tf.Tensor:
        window = tf.cast(window, tf.int32)
        inputs, targets = window[:, :-1], window[:, 1:]
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = tf.reduce_mean(window_bits_per_byte(logits, targets))
        grads = tape.gradient(loss, train_vars)
        adam.apply(grads[: len(dense_vars)], dense_vars)
        if sparse is not None:
            sparse.apply(grads[-1:], [values])
        return loss

    return step, adam, sparse


def evaluator(model: ByteLM) -> Callable[[np.ndarray, int], np.ndarray]:
    """A function (windows [n, T + 1] uint8, batch size) -> per-window bits per byte [n]."""

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.uint8)])
    def score(window: tf.Tensor) -> tf.Tensor:
        window = tf.cast(window, tf.int32)
        return window_bits_per_byte(model(window[:, :-1], training=False), window[:, 1:])

    def evaluate(windows: np.ndarray, batch: int) -> np.ndarray:
        return np.concatenate(
            [
                score(tf.constant(windows[i : i + batch])).numpy()
                for i in range(0, len(windows), batch)
            ]
        )

    return evaluate


def train_models(
    models: Dict[str, ByteLM],
    corpus: Corpus,
    config: LMTrainConfig,
    progress: Optional[Callable[[int, Dict[str, Dict[str, float]]], None]] = None,
) -> Dict[str, Dict[str, Any]]:
    """Trains `models` in lockstep for `config.steps` steps on `corpus.train`.

    Step i draws one batch (`train_windows(..., seed, i)`) and gives it to each model in
    turn, so the models see the same data and, on a shared machine, the same load while
    they are timed. Every `config.eval_every` steps and at the end, each model is scored
    on the fixed validation subset (not timed as training).

    Args:
      models: name -> a built `ByteLM` (see `build_model`); all with the same context.
      corpus: The text.
      config: The training and evaluation settings.
      progress: Called after each step with (steps done, {name: logs}); logs hold
        `loss_bpb`, and `val_bpb` after an evaluation.

    Returns:
      name -> `eval_steps` and `val_bpb` (the learning curve), `train_bpb` (the loss of
      every step), `window_bpb` (per validation window at the end), `final_val_bpb`,
      `steps_per_s` (training steps after 3 warm-up steps), `train_s` (all its training
      steps, tracing included), `eval_s` and `params` (see `parameter_counts`).
    """
    contexts = {model.config.context for model in models.values()}
    if len(contexts) != 1:
        raise ValueError(f"the models must share one context, got {sorted(contexts)}")
    context = contexts.pop()
    windows = eval_windows(corpus.validation, config.eval_windows, context)
    runs = {}
    for name, model in models.items():
        step, _, _ = make_step(model, config)
        runs[name] = {
            "step": step,
            "evaluate": evaluator(model),
            "train_bpb": [],
            "step_s": [],
            "eval_steps": [],
            "val_bpb": [],
            "window_bpb": np.zeros(0),
            "eval_s": 0.0,
        }
    for i in range(config.steps):
        batch = tf.constant(train_windows(corpus.train, config.batch, context, config.seed, i))
        evaluate_now = (i + 1) % config.eval_every == 0 or i + 1 == config.steps
        logs: Dict[str, Dict[str, float]] = {}
        for name, run in runs.items():
            start = time.perf_counter()
            loss = float(run["step"](batch))
            run["step_s"].append(time.perf_counter() - start)
            run["train_bpb"].append(loss)
            logs[name] = {"loss_bpb": loss}
        if evaluate_now:
            for name, run in runs.items():
                start = time.perf_counter()
                run["window_bpb"] = run["evaluate"](windows, config.eval_batch)
                run["eval_s"] += time.perf_counter() - start
                run["eval_steps"].append(i + 1)
                run["val_bpb"].append(float(run["window_bpb"].mean()))
                logs[name]["val_bpb"] = run["val_bpb"][-1]
        if progress is not None:
            progress(i + 1, logs)
    results = {}
    for name, run in runs.items():
        timed = run["step_s"][3:] if len(run["step_s"]) > 3 else run["step_s"]
        results[name] = {
            "eval_steps": run["eval_steps"],
            "val_bpb": run["val_bpb"],
            "train_bpb": run["train_bpb"],
            "window_bpb": run["window_bpb"].tolist(),
            "final_val_bpb": run["val_bpb"][-1],
            "steps_per_s": len(timed) / sum(timed),
            "train_s": float(sum(run["step_s"])),
            "eval_s": run["eval_s"],
            "params": parameter_counts(models[name]),
        }
    return results


# ----------------------------------------------------------------------------------------
# Memory statistics.


def memory_statistics(model: ByteLM, windows: np.ndarray, batch: int) -> Optional[Dict[str, Any]]:
    """The memory's slot usage and KL from uniform over the tokens of `windows`.

    `ProductKeyMemory.memory_stats` (inference mode) on the hidden states the memory
    reads for the inputs of `windows` ([n, T + 1] bytes; the last byte of each is only a
    target). Returns its `MemoryStats.as_dict()` (`usage_percent`, `kl_from_uniform` in
    nats, ...), or None when `model` has no memory.
    """
    layer = model.memory()
    if layer is None:
        return None
    hidden = tf.function(
        model.memory_inputs, input_signature=[tf.TensorSpec([None, None], tf.uint8)]
    )
    batches = [windows[i : i + batch, :-1] for i in range(0, len(windows), batch)]
    return layer.memory_stats(batches, inputs_fn=lambda b: hidden(tf.constant(b))).as_dict()


# ----------------------------------------------------------------------------------------
# The section.

BASELINE = "without memory"
MEMORY = "with ProductKeyMemory"


def paired_difference(memory: Sequence[float], baseline: Sequence[float]) -> Tuple[float, float]:
    """Mean and standard error of (memory - baseline) over the same validation windows."""
    diff = np.asarray(memory, np.float64) - np.asarray(baseline, np.float64)
    if diff.size < 2:
        return float(diff.mean()), float("nan")
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(diff.size))


def verdict(results: Dict[str, Dict[str, Any]]) -> str:
    """One line comparing the two models, computed from their numbers."""
    base, mem = results[BASELINE], results[MEMORY]
    mean, se = paired_difference(mem["window_bpb"], base["window_bpb"])
    speed = mem["steps_per_s"] / base["steps_per_s"]
    relative = 100.0 * mean / base["final_val_bpb"]
    noise = (
        f"{mean:+.3f} ± {2 * se:.3f} bpb (2 standard errors over the validation windows, "
        "one training seed)"
    )
    if mean + 2 * se < 0:
        quality = f"the memory model's validation bpb is lower by {-mean:.3f} ({-relative:.1f}%)"
    elif mean - 2 * se > 0:
        quality = f"the memory model's validation bpb is higher by {mean:.3f} ({relative:.1f}%)"
    else:
        quality = "no validation-bpb difference beyond noise"
    return (
        f"=> At {len(base['train_bpb'])} equal steps: {quality}, {noise}; it trains at "
        f"{speed:.2f}x the baseline's steps/s with "
        f"{mem['params']['total'] / base['params']['total']:.1f}x its parameters."
    )


def _moving_average(values: Sequence[float], width: int) -> np.ndarray:
    values = np.asarray(values, np.float64)
    width = max(1, min(width, values.size))
    kernel = np.ones(width) / width
    # "valid" part only, so early points are not biased towards zero.
    return np.convolve(values, kernel, mode="valid")


def _plot(path: str, results: Dict[str, Dict[str, Any]], title: str) -> bool:
    """Validation bpb vs step and training loss vs step; False when matplotlib is missing."""

    def draw(axes_pair):
        left, right = axes_pair
        for index, (name, r) in enumerate(results.items()):
            color = f"C{index}"
            left.plot(r["eval_steps"], r["val_bpb"], marker="o", color=color, label=name)
            steps = np.arange(1, len(r["train_bpb"]) + 1)
            right.plot(steps, r["train_bpb"], color=color, alpha=0.25, linewidth=0.8)
            width = max(1, len(steps) // 20)
            smooth = _moving_average(r["train_bpb"], width)
            right.plot(
                steps[width - 1 :], smooth, color=color, label=f"{name} (moving mean of {width})"
            )
        left.set_ylabel("validation bits per byte, lower is better")
        right.set_ylabel("training loss (bits per byte)")
        # Leave out the first steps' ~8 bits, which would flatten the rest of the curves.
        later = [v for r in results.values() for v in r["train_bpb"][len(r["train_bpb"]) // 20 :]]
        if later:
            right.set_ylim(min(later) - 0.1, max(later) + 0.1)
        for axes in (left, right):
            axes.set_xlabel("training step")
            axes.grid(True, alpha=0.3)
            axes.legend(fontsize="small")

    return _util.save_two_panel_plot(path, title, draw)


@dataclasses.dataclass(frozen=True)
class LMRunOptions:
    """The section's sizes, from the command line."""

    model: LMConfig
    train: LMTrainConfig


def run_options(args: argparse.Namespace) -> LMRunOptions:
    """The section's model and training configuration for `args` (`--lm-*`, `--quick`)."""
    if args.quick:
        steps, eval_every, windows = 30, 10, 32
    elif args.lm_long:
        steps, eval_every, windows = 2000, 200, 1024
    else:
        defaults = LMTrainConfig()
        steps, eval_every, windows = defaults.steps, defaults.eval_every, defaults.eval_windows
    if args.lm_steps is not None:
        steps = args.lm_steps
        eval_every = max(1, min(eval_every, steps // 4 or 1))
    train = LMTrainConfig(
        steps=steps,
        batch=args.lm_batch,
        lr=args.lm_lr,
        values_lr=args.lm_values_lr,
        warmup=max(1, steps // 10),
        eval_every=eval_every,
        eval_windows=windows,
        seed=args.seed,
    )
    return LMRunOptions(model=LMConfig(), train=train)


def section(args: argparse.Namespace) -> Dict[str, Any]:
    """Byte-level LM on the stdlib's source without vs with a ProductKeyMemory layer."""
    options = run_options(args)
    corpus = load_corpus()
    train = options.train
    print(f"Text: {corpus.describe()}.")
    print(f"Model: byte-level causal transformer, {options.model.describe()}.")
    memory_config = dataclasses.replace(options.model, memory=True)
    print(f"Memory model: {memory_config.describe()}.")
    print(
        f"Training: {train.steps} steps x {train.batch} windows of {options.model.context} "
        f"bytes (same batches for both), Adam lr {train.lr:g} with {train.warmup} warm-up "
        f"steps and cosine decay to 10%; memory values: tf_ttemb.optimizers.LazyAdam, lr "
        f"{train.values_lr:g}, same schedule. Validation: {train.eval_windows} fixed windows "
        f"({train.eval_windows * options.model.context:,} predicted bytes), every "
        f"{train.eval_every} steps and at the end."
    )
    configs = {BASELINE: options.model}
    if _memory_layer_class() is None:
        print("tf_ttemb.layers.ProductKeyMemory is not available yet: only the baseline runs.")
    else:
        configs[MEMORY] = memory_config

    windows = eval_windows(corpus.validation, train.eval_windows, options.model.context)
    models = {name: build_model(config, train.seed) for name, config in configs.items()}
    short = {BASELINE: "base", MEMORY: "pkm"}
    metrics = [f"{short[name]}_{key}" for name in models for key in ("loss", "val")]
    print(
        f"Training {' and '.join(models)} in lockstep (each step, one batch for each model in "
        "turn); losses and validation in bits per byte:"
    )
    bar = keras.utils.Progbar(train.steps, unit_name="step", stateful_metrics=metrics)

    def report(step: int, logs: Dict[str, Dict[str, float]]) -> None:
        values = []
        for name, model_logs in logs.items():
            values.append((f"{short[name]}_loss", model_logs["loss_bpb"]))
            if "val_bpb" in model_logs:
                values.append((f"{short[name]}_val", model_logs["val_bpb"]))
        bar.update(step, values)

    results = train_models(models, corpus, train, report)
    for name, model in models.items():
        results[name]["memory_stats"] = memory_statistics(model, windows, train.eval_batch)
    del models

    print(
        f"\nAfter {train.steps} steps (validation: {train.eval_windows} windows of Python "
        f"{corpus.python_version}'s stdlib):"
    )
    headers = ["model", "params", "memory values", "other params", "val bpb", "steps/s", "train s"]
    rows = [
        [
            name,
            f"{r['params']['total']:,}",
            f"{r['params']['memory_values']:,}",
            f"{r['params']['other']:,}",
            f"{r['final_val_bpb']:.4f}",
            f"{r['steps_per_s']:.2f}",
            f"{r['train_s']:.1f}",
        ]
        for name, r in results.items()
    ]
    print(_util.format_table(headers, rows))
    stats = results.get(MEMORY, {}).get("memory_stats")
    if stats:
        print(
            f"Memory on the validation windows ({stats['tokens']:,} tokens): "
            f"{stats['usage_percent']:.1f}% of the {stats['num_slots']:,} slots read, KL "
            f"from uniform {stats['kl_from_uniform']:.3f} nats (log {stats['num_slots']:,} = "
            f"{math.log(stats['num_slots']):.2f} if one slot took all the weight)."
        )
    if MEMORY in results:
        print(verdict(results))
    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    print(
        "bpb: bits per byte, mean cross-entropy over every predicted byte of the windows. "
        f"steps/s: training steps only (forward, gradients, updates; tf.function, {threads} "
        "threads), after 3 warm-up steps, both models timed in the same interleaved run; "
        "train s: all training steps, tracing included, evaluation not."
    )

    document = {
        "corpus": {
            "python_version": corpus.python_version,
            "directory": corpus.directory,
            "train_files": list(corpus.train_files),
            "validation_files": list(corpus.validation_files),
            "train_bytes": int(corpus.train.size),
            "validation_bytes": int(corpus.validation.size),
            "fingerprint": corpus.fingerprint(),
        },
        "models": {name: dataclasses.asdict(config) for name, config in configs.items()},
        "train": dataclasses.asdict(train),
        "results": results,
    }
    if MEMORY in results:
        document["verdict"] = verdict(results)
    title = (
        f"Byte-level LM on Python {corpus.python_version}'s stdlib source: "
        f"{options.model.layers} layers, d_model {options.model.d_model}"
    )
    _util.save_results(args, "pkm_lm", document, lambda path: _plot(path, results, title))
    return document
