"""Smoke tests of the building blocks of the demo's `tt_quality` section (tiny sizes)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tf_ttemb import demo as demo_cli
from tf_ttemb.demo import tt_quality as demo


def _task(**overrides) -> demo.CtrTask:
    settings = dict(rows=1_000, seed=3)
    settings.update(overrides)
    return demo.CtrTask(**settings)


def _pairwise_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUC by brute force over all (positive, negative) pairs; ties count one half."""
    pos = scores[labels.astype(bool)]
    neg = scores[~labels.astype(bool)]
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return (greater + 0.5 * ties) / (pos.size * neg.size)


@pytest.mark.parametrize("discrete", [False, True], ids=["continuous", "with_ties"])
def test_auc_matches_pairwise_count(rng, discrete):
    labels = (rng.random(300) < 0.3).astype(np.float32)
    scores = rng.normal(size=300) + labels
    if discrete:
        scores = np.round(scores)  # many tied scores, across and within classes
    assert demo.auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)


def test_auc_edge_cases():
    assert demo.auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert demo.auc([0, 0, 1, 1], [0.4, 0.3, 0.2, 0.1]) == 0.0
    assert demo.auc([0, 1, 0, 1], [1.0, 1.0, 1.0, 1.0]) == 0.5
    assert np.isnan(demo.auc([1, 1, 1], [0.1, 0.2, 0.3]))


def test_logloss_matches_direct_formula(rng):
    labels = (rng.random(500) < 0.4).astype(np.float32)
    logits = 3.0 * rng.normal(size=500)
    p = 1.0 / (1.0 + np.exp(-logits))
    direct = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    assert demo.logloss(labels, logits) == pytest.approx(direct, rel=1e-10)
    # Stable for large logits, where the direct formula overflows.
    assert demo.logloss([1.0, 0.0], [800.0, -800.0]) == pytest.approx(0.0, abs=1e-300)
    assert demo.logloss([0.0], [800.0]) == pytest.approx(800.0)


def test_planted_vectors_are_a_function_of_the_id():
    task = _task(planted_dim=6)
    ids = np.array([5, 17, 5, 999, 0])
    vectors = demo.planted_vectors(task, 1, ids)
    assert vectors.shape == (5, 6)
    np.testing.assert_array_equal(vectors[0], vectors[2])  # same id, same vector
    np.testing.assert_array_equal(vectors[1], demo.planted_vectors(task, 1, np.array([17]))[0])
    assert not np.array_equal(vectors[0], demo.planted_vectors(task, 2, ids)[0])  # per feature
    other_seed = demo.planted_vectors(_task(planted_dim=6, seed=4), 1, ids)
    assert not np.array_equal(vectors, other_seed)


def test_planted_vectors_are_uniform_with_unit_variance():
    task = _task(rows=1 << 20, planted_dim=8)
    vectors = demo.planted_vectors(task, 0, np.arange(50_000))
    assert np.abs(vectors).max() <= np.sqrt(3.0)
    assert abs(vectors.mean()) < 0.01
    assert vectors.var() == pytest.approx(1.0, abs=0.02)
    # Full rank over the ids: no low-rank structure a compressed table could exploit.
    correlation = np.corrcoef(vectors.T)
    assert np.abs(correlation - np.eye(8)).max() < 0.03


def test_ctr_data_shapes_ranges_and_determinism():
    task = _task()
    model = demo.planted_model(task)
    data = demo.ctr_data(task, model, 2_000, stream=0)
    assert data["ids"].shape == (2_000, task.num_features) and data["ids"].dtype == np.int64
    assert data["dense"].shape == (2_000, task.dense_features)
    assert data["dense"].dtype == np.float32
    assert data["labels"].shape == (2_000,) and set(np.unique(data["labels"])) <= {0.0, 1.0}
    assert data["ids"].min() >= 0 and data["ids"].max() < task.rows
    again = demo.ctr_data(task, demo.planted_model(task), 2_000, stream=0)
    for key in data:
        np.testing.assert_array_equal(data[key], again[key])
    other = demo.ctr_data(task, model, 2_000, stream=1)
    assert not np.array_equal(data["ids"], other["ids"])


def test_ctr_data_follows_the_planted_model():
    task = _task(rows=10_000)
    model = demo.planted_model(task)
    data = demo.ctr_data(task, model, 40_000, stream=0)
    logits = data["dense"].astype(np.float64) @ model.dense_weights + task.bias
    for f in range(task.num_features):
        logits += demo.planted_vectors(task, f, data["ids"][:, f]) @ model.directions[f]
    np.testing.assert_allclose(data["logits"], logits, rtol=1e-6, atol=1e-6)
    # Labels are Bernoulli(sigmoid(logit)): calibrated overall and by logit decile.
    p = 1.0 / (1.0 + np.exp(-logits))
    assert data["labels"].mean() == pytest.approx(p.mean(), abs=0.01)
    deciles = np.quantile(logits, np.linspace(0, 1, 11))
    bins = np.digitize(logits, deciles[1:-1])
    for b in range(10):
        assert data["labels"][bins == b].mean() == pytest.approx(p[bins == b].mean(), abs=0.03)
    # Each feature's term has the configured scale over the ids (Zipf-weighted samples
    # are dominated by a few hot ids).
    term = demo.planted_vectors(task, 0, np.arange(task.rows)) @ model.directions[0]
    assert term.std() == pytest.approx(task.embedding_scale, rel=0.1)


def test_zipf_ids():
    task = _task(rows=5_000, zipf_exponent=1.1)
    model = demo.planted_model(task)
    for f in range(task.num_features):  # a permutation per feature
        np.testing.assert_array_equal(np.sort(model.permutations[f]), np.arange(task.rows))
    weights = np.arange(1, task.rows + 1, dtype=np.float64) ** -1.1
    expected = weights / weights.sum()
    np.testing.assert_allclose(np.diff(model.zipf_cdf, prepend=0.0), expected, rtol=1e-9)

    ranks = demo.zipf_ranks(model.zipf_cdf, 200_000, np.random.default_rng(0))
    assert ranks.min() >= 0 and ranks.max() < task.rows
    counts = np.bincount(ranks, minlength=task.rows) / ranks.size
    for r in (0, 1, 9):  # the head follows r^-1.1
        assert counts[r] == pytest.approx(expected[r], rel=0.05)
    assert counts[:100].sum() == pytest.approx(expected[:100].sum(), abs=0.01)

    data = demo.ctr_data(task, model, 50_000, stream=0)
    hottest = model.permutations[0][0]  # rank 0 of feature 0, somewhere in the table
    assert (data["ids"][:, 0] == hottest).mean() == pytest.approx(expected[0], rel=0.1)


def test_training_a_tiny_model_beats_the_dense_only_one():
    task = _task(rows=200, embedding_scale=1.5)
    model = demo.planted_model(task)
    config = demo.TrainConfig(steps=150, batch=128)
    train = demo.ctr_data(task, model, config.steps * config.batch, stream=0)
    test = demo.ctr_data(task, model, 5_000, stream=1)
    results = {}
    for name, bags in (
        ("full", [demo.tf_ttemb.layers.EmbeddingBag(task.rows, 4) for _ in range(3)]),
        ("dense", []),
    ):
        seen = []
        results[name] = demo.train_ctr_model(
            demo.CtrModel(bags, hidden=(8,)), train, test, config, lambda i, _: seen.append(i)
        )
        assert seen == list(range(1, config.steps + 1))
    full, dense = results["full"], results["dense"]
    assert full["embedding_params"] == 3 * task.rows * 4 and dense["embedding_params"] == 0
    ceiling = demo.auc(test["labels"], test["logits"])
    assert dense["auc"] < full["auc"] <= ceiling + 0.01
    assert full["logloss"] < dense["logloss"]
    for result in results.values():
        assert result["step_ms"] > 0 and np.isfinite(result["train_logloss"])


def test_training_a_tiny_tt_model():
    layer_class = getattr(demo.tf_ttemb.layers, "TTEmbeddingBag", None)
    if layer_class is None:
        pytest.skip("tf_ttemb.layers.TTEmbeddingBag does not exist yet")
    from tf_ttemb import tt

    task = _task(rows=300, embedding_scale=1.5)
    model = demo.planted_model(task)
    config = demo.TrainConfig(steps=100, batch=128)
    train = demo.ctr_data(task, model, config.steps * config.batch, stream=0)
    test = demo.ctr_data(task, model, 5_000, stream=1)
    factories = demo._bag_factories(task, 8, [2], "composite")
    rank, make_bag = factories["TTEmbeddingBag rank 2"]
    assert rank == 2
    bags = [make_bag() for _ in range(task.num_features)]
    before = [np.array(c) for c in bags[0].cores]
    result = demo.train_ctr_model(demo.CtrModel(bags, hidden=(8,)), train, test, config)
    p, q, ranks = tt.resolve_shapes(task.rows, 8, 2)
    assert result["embedding_params"] == task.num_features * tt.num_parameters(p, q, ranks)
    assert all(not np.array_equal(b, np.array(c)) for b, c in zip(before, bags[0].cores))
    assert 0.5 < result["auc"] <= demo.auc(test["labels"], test["logits"]) + 0.01


def test_ctr_model_trains_with_too_few_examples_raises():
    task = _task(rows=50)
    model = demo.planted_model(task)
    data = demo.ctr_data(task, model, 100, stream=0)
    with pytest.raises(ValueError, match="need 1,280 training examples, got 100"):
        demo.train_ctr_model(demo.CtrModel([]), data, data, demo.TrainConfig(steps=10, batch=128))


def test_section_options():
    parser = argparse.ArgumentParser()
    demo_cli.add_arguments(parser)
    args = parser.parse_args(["--sections", "tt_quality"])
    assert args.sections == ["tt_quality"]
    assert args.tt_rows == 1_000_000 and args.tt_ranks == [4, 16, 64]
    args = parser.parse_args(["--sections", "tt_quality", "--tt-ranks", "2,8", "--quick"])
    assert args.tt_ranks == [2, 8]
    demo_cli.apply_quick(args)
    assert args.tt_rows < 1_000_000 and args.tt_steps < demo.TrainConfig.steps
