"""Tests of the building blocks of the demo's `pkm_lm` section (tiny sizes)."""

from __future__ import annotations

import argparse
import os
import zlib

import numpy as np
import pytest
import tensorflow as tf

from tf_ttemb import demo
from tf_ttemb.demo import pkm_lm as lm

needs_memory = pytest.mark.skipif(
    lm._memory_layer_class() is None, reason="tf_ttemb.layers.ProductKeyMemory is not there yet"
)


def _write(directory, name: str, data: bytes) -> None:
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _tiny_corpus(rng, size: int = 5_000) -> lm.Corpus:
    text = rng.integers(32, 127, size, dtype=np.uint8)
    return lm.Corpus("<memory>", "3.x", ("a.py",), ("b.py",), text, text[: size // 5].copy())


# ----------------------------------------------------------------------------------------
# The corpus.


def test_corpus_files_are_the_sorted_top_level_py_files(tmp_path):
    names = ["zeta.py", "alpha.py", "Beta.py", "notes.txt", "pkg/__init__.py", "site-packages/x.py"]
    for name in names:
        _write(tmp_path, name, name.encode())
    os.makedirs(tmp_path / "dir.py")  # a directory named like a module is not a file
    assert lm.corpus_files(str(tmp_path)) == ["Beta.py", "alpha.py", "zeta.py"]


def test_split_rule_is_the_crc32_bucket():
    names = [f"module_{i}.py" for i in range(200)]
    validation = [n for n in names if lm.is_validation_file(n)]
    assert validation == [n for n in names if zlib.crc32(n.encode()) % 10 == 0]
    assert 5 <= len(validation) <= 40  # about a tenth


def test_load_corpus_splits_disjointly_and_concatenates_in_order(tmp_path):
    names = [f"m{i:02d}.py" for i in range(40)]
    for name in names:
        _write(tmp_path, name, f"# {name}\nx = {name!r}\n".encode())
    corpus = lm.load_corpus(str(tmp_path))
    assert set(corpus.train_files).isdisjoint(corpus.validation_files)
    assert sorted(corpus.train_files + corpus.validation_files) == names
    assert list(corpus.train_files) == sorted(corpus.train_files)
    assert all(lm.is_validation_file(n) for n in corpus.validation_files)
    assert not any(lm.is_validation_file(n) for n in corpus.train_files)
    expected = b"".join((tmp_path / n).read_bytes() for n in corpus.validation_files)
    assert corpus.validation.tobytes() == expected
    assert corpus.train.dtype == np.uint8
    again = lm.load_corpus(str(tmp_path))
    assert again.train_files == corpus.train_files
    assert again.fingerprint() == corpus.fingerprint()


def test_load_corpus_needs_both_splits(tmp_path):
    name = next(f"m{i}.py" for i in range(100) if not lm.is_validation_file(f"m{i}.py"))
    _write(tmp_path, name, b"x = 1\n")
    with pytest.raises(ValueError, match="1 .py files: too few"):
        lm.load_corpus(str(tmp_path))


def test_stdlib_corpus_is_deterministic_and_disjoint():
    first, second = lm.load_corpus(), lm.load_corpus()
    assert first.directory == lm.stdlib_directory()
    assert first.train_files == second.train_files
    assert first.validation_files == second.validation_files
    assert first.fingerprint() == second.fingerprint()
    assert set(first.train_files).isdisjoint(first.validation_files)
    assert len(first.validation_files) >= 1 and first.validation.size > 10_000
    assert "os.py" in first.train_files + first.validation_files
    assert not any("/" in name for name in first.train_files)  # top level only


# ----------------------------------------------------------------------------------------
# Batches and bits per byte.


def test_train_windows_are_seeded_random_slices():
    data = (np.arange(10_000) * 7919 % 65_521 % 256).astype(np.uint8)
    windows = lm.train_windows(data, batch=8, context=32, seed=1, step=5)
    assert windows.shape == (8, 33) and windows.dtype == np.uint8
    np.testing.assert_array_equal(windows, lm.train_windows(data, 8, 32, seed=1, step=5))
    assert not np.array_equal(windows, lm.train_windows(data, 8, 32, seed=1, step=6))
    assert not np.array_equal(windows, lm.train_windows(data, 8, 32, seed=2, step=5))
    for row in windows:  # each row is data[s : s + 33] for some s
        starts = [s for s in range(data.size - 32) if np.array_equal(data[s : s + 33], row)]
        assert starts


def test_train_windows_reach_both_ends():
    data = np.arange(40, dtype=np.uint8)
    windows = lm.train_windows(data, batch=2_000, context=9, seed=0, step=0)
    firsts = set(windows[:, 0].tolist())
    assert firsts == set(range(31))  # every start from 0 to size - context - 1
    np.testing.assert_array_equal(windows[:, 1:] - windows[:, :-1], 1)


def test_eval_windows_are_fixed_and_evenly_spaced():
    data = (np.arange(1_000) % 256).astype(np.uint8)
    windows = lm.eval_windows(data, count=5, context=99)
    assert windows.shape == (5, 100)
    starts = [0, 225, 450, 675, 900]
    for row, start in zip(windows, starts):
        np.testing.assert_array_equal(row, np.arange(start, start + 100) % 256)
    np.testing.assert_array_equal(lm.eval_windows(data, 5, 99), lm.eval_windows(data, 5, 99))


def test_windows_need_enough_bytes():
    with pytest.raises(ValueError, match="windows of 11 bytes need that many bytes, got 10"):
        lm.eval_windows(np.zeros(10, np.uint8), 2, 10)
    with pytest.raises(ValueError, match="need that many bytes"):
        lm.train_windows(np.zeros(10, np.uint8), 2, 10, 0, 0)


def test_bits_per_byte_matches_numpy(rng):
    logits = 3.0 * rng.standard_normal((3, 5, 7, lm.VOCAB))
    targets = rng.integers(0, lm.VOCAB, (3, 5, 7))
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    chosen = np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    expected = -chosen.mean(axis=-1) / np.log(2.0)
    got = lm.window_bits_per_byte(tf.constant(logits, tf.float32), tf.constant(targets))
    assert got.shape == (3, 5)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
    # A uniform prediction costs exactly 8 bits per byte.
    uniform = lm.window_bits_per_byte(tf.zeros([2, 4, lm.VOCAB]), tf.zeros([2, 4], tf.int32))
    np.testing.assert_allclose(uniform.numpy(), 8.0, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# Optimisation.


def test_warmup_cosine_schedule():
    schedule = lm.WarmupCosine(peak=1.0, warmup=10, total=110, final=0.1)
    assert float(schedule(0)) == pytest.approx(0.1)
    assert float(schedule(9)) == pytest.approx(1.0)
    assert float(schedule(60)) == pytest.approx(0.55)
    assert float(schedule(110)) == pytest.approx(0.1)
    assert float(schedule(500)) == pytest.approx(0.1)


# ----------------------------------------------------------------------------------------
# Models and training.

TINY = lm.LMConfig(
    layers=1, d_model=16, heads=2, context=8, ffn_mult=2, n_keys=8, k_dim=8, memory_heads=2, knn=4
)


def test_causal_attention_does_not_look_ahead(rng):
    layer = lm.CausalSelfAttention(8, 2)
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)
    changed = x.copy()
    changed[:, 4:] += 5.0  # only the last two positions differ
    a, b = layer(tf.constant(x)).numpy(), layer(tf.constant(changed)).numpy()
    np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 4:], b[:, 4:])


def test_baseline_model_builds_and_trains_one_step(rng):
    model = lm.ByteLM(TINY)
    logits = model(tf.constant(rng.integers(0, 256, (3, 8))))
    assert logits.shape == (3, 8, lm.VOCAB)
    assert model.memory() is None and lm.memory_values(model) is None
    assert lm.memory_statistics(model, np.zeros((2, 9), np.uint8), batch=2) is None
    counts = lm.parameter_counts(model)
    assert counts["memory_values"] == 0 and counts["other"] == counts["total"] > 0
    config = lm.LMTrainConfig(steps=5, batch=4, warmup=1)
    step, _, sparse = lm.make_step(model, config)
    assert sparse is None
    before = [v.numpy().copy() for v in model.trainable_variables]
    window = tf.constant(rng.integers(0, 256, (4, 9)), tf.uint8)
    loss = float(step(window))
    assert 5.0 < loss < 11.0  # about 8 bits per byte at initialisation
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


@needs_memory
def test_memory_model_builds_and_trains_one_step(rng):
    config = lm.dataclasses.replace(TINY, memory=True, n_keys=32)  # 1,024 slots
    model = lm.ByteLM(config)
    assert model(tf.constant(rng.integers(0, 256, (3, 8)))).shape == (3, 8, lm.VOCAB)
    assert isinstance(model.memory(), lm.tf_ttemb.layers.ProductKeyMemory)
    values = lm.memory_values(model)
    assert tuple(values.shape) == (config.n_keys**2, config.d_model)
    counts = lm.parameter_counts(model)
    assert counts["memory_values"] == config.n_keys**2 * config.d_model
    assert counts["total"] == counts["memory_values"] + counts["other"]
    step, adam, sparse = lm.make_step(model, lm.LMTrainConfig(steps=5, batch=4, warmup=1))
    assert isinstance(sparse, lm.tf_ttemb.optimizers.LazyAdam)

    def slots_read(window: tf.Tensor) -> set:
        with tf.GradientTape() as tape:
            logits = model(tf.cast(window[:, :-1], tf.int32), training=True)
            loss = tf.reduce_mean(lm.window_bits_per_byte(logits, window[:, 1:]))
        grad = tape.gradient(loss, values)
        assert isinstance(grad, tf.IndexedSlices)  # the slots this batch read
        return set(grad.indices.numpy().tolist())

    def rows_changed_by_step(window: tf.Tensor) -> set:
        table = values.numpy().copy()
        assert np.isfinite(float(step(window)))
        return set(np.flatnonzero(np.any(values.numpy() != table, axis=1)).tolist())

    first, second = (tf.constant(rng.integers(0, 256, (4, 9)), tf.uint8) for _ in range(2))
    read = slots_read(first)
    assert 0 < len(read) < config.n_keys**2
    assert rows_changed_by_step(first) == read  # same batch and weights: same slots read
    read_next = slots_read(second)
    assert read - read_next  # some rows read by the first batch only...
    assert rows_changed_by_step(second) == read_next  # ...stay put (a dense Adam moves them)
    assert int(sparse.iterations) == 2 and int(adam.iterations) == 2
    assert model.memory_inputs(second[:, :-1]).shape == (4, 8, config.d_model)
    windows = rng.integers(0, 256, (5, 9)).astype(np.uint8)
    stats = lm.memory_statistics(model, windows, batch=2)
    assert stats["tokens"] == 5 * 8 and stats["num_slots"] == config.n_keys**2
    assert 0 < stats["usage_percent"] <= 100 and stats["kl_from_uniform"] >= 0


def test_train_models_runs_in_lockstep_on_the_same_batches(rng):
    corpus = _tiny_corpus(rng)
    config = lm.LMTrainConfig(
        steps=5, batch=3, warmup=1, eval_every=2, eval_windows=5, eval_batch=2
    )
    seen = []
    models = {name: lm.build_model(TINY, seed=5) for name in ("a", "b")}
    results = lm.train_models(models, corpus, config, lambda i, logs: seen.append((i, logs)))
    # Same seed, same architecture, same batches: the same numbers.
    np.testing.assert_allclose(results["a"]["train_bpb"], results["b"]["train_bpb"], rtol=1e-5)
    np.testing.assert_allclose(results["a"]["val_bpb"], results["b"]["val_bpb"], rtol=1e-5)
    result = results["a"]
    assert result["eval_steps"] == [2, 4, 5]
    assert len(result["val_bpb"]) == 3 and len(result["train_bpb"]) == 5
    assert len(result["window_bpb"]) == 5
    assert result["final_val_bpb"] == pytest.approx(np.mean(result["window_bpb"]), rel=1e-6)
    assert result["steps_per_s"] > 0 and result["params"]["memory_values"] == 0
    assert [i for i, _ in seen] == [1, 2, 3, 4, 5]
    assert all(sorted(logs) == ["a", "b"] for _, logs in seen)
    assert "val_bpb" in seen[1][1]["b"] and "val_bpb" not in seen[0][1]["b"]
    other = lm.dataclasses.replace(TINY, context=6)
    with pytest.raises(ValueError, match=r"share one context, got \[6, 8\]"):
        lm.train_models({"a": models["a"], "b": lm.build_model(other, 5)}, corpus, config)


# ----------------------------------------------------------------------------------------
# The report.


def _fake_results(memory_windows, baseline_windows, memory_speed=2.0):
    def one(windows, speed, params):
        return {
            "window_bpb": windows,
            "final_val_bpb": float(np.mean(windows)),
            "steps_per_s": speed,
            "train_bpb": [3.0] * 10,
            "params": {"total": params},
        }

    return {
        lm.BASELINE: one(baseline_windows, 4.0, 100),
        lm.MEMORY: one(memory_windows, memory_speed, 1_000),
    }


def test_verdict_is_computed_from_the_numbers(rng):
    base = 2.0 + 0.1 * rng.standard_normal(200)
    lower = lm.verdict(_fake_results(base - 0.05, base))
    assert "lower by 0.050" in lower and "0.50x the baseline's steps/s" in lower
    assert "-0.050 ± 0.000 bpb" in lower
    assert "10.0x its parameters" in lower and "At 10 equal steps" in lower
    assert "higher by 0.050" in lm.verdict(_fake_results(base + 0.05, base))
    noisy = base + 0.2 * rng.standard_normal(200) * np.sign(rng.standard_normal(200))
    noisy += 0.001 - np.mean(noisy - base)
    assert "no validation-bpb difference beyond noise" in lm.verdict(_fake_results(noisy, base))


def test_paired_difference():
    mean, se = lm.paired_difference([1.0, 2.0, 4.0], [0.0, 1.0, 1.0])
    assert mean == pytest.approx(5.0 / 3.0)
    assert se == pytest.approx(np.std([1.0, 1.0, 3.0], ddof=1) / np.sqrt(3))


def _args(*argv):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_run_options_default_quick_long_and_steps():
    default = lm.run_options(_args()).train
    assert default.steps == lm.LMTrainConfig.steps and default.eval_windows == 256
    quick = lm.run_options(_args("--quick")).train
    assert quick.steps < default.steps and quick.eval_windows < default.eval_windows
    long = lm.run_options(_args("--lm-long")).train
    assert long.steps == 2000 and long.eval_windows == 1024
    explicit = lm.run_options(_args("--quick", "--lm-steps", "12", "--lm-batch", "3")).train
    assert (explicit.steps, explicit.batch, explicit.eval_every) == (12, 3, 3)
    assert "pkm_lm" in _args().sections


def test_plot_writes_a_png(tmp_path, rng):
    pytest.importorskip("matplotlib")
    results = _fake_results(2.0 + rng.random(8), 2.1 + rng.random(8))
    for r in results.values():
        r.update(eval_steps=[5, 10], val_bpb=[3.0, 2.5], train_bpb=list(8.0 - 0.5 * np.arange(10)))
    path = tmp_path / "pkm_lm.png"
    assert lm._plot(str(path), results, "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
