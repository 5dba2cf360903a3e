"""Tests of the numpy TT helpers (`tf_ttemb.tt`): shapes, expansion, TT-SVD, initialisation.

Pure numpy (no op library). The expansion functions are checked against a slow loop over
digits and rank indices written here from the contract's formula, the initialisers
against the laws they claim, on rows sampled with `tt.rows` (never the full table).
"""

from __future__ import annotations

import doctest
import itertools
import math
import re

import numpy as np
import pytest

from tf_ttemb import tt

# --------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------


def slow_table(cores, p, q, ranks, num_rows):
    """Every entry from the contract's formula: explicit digits, explicit rank sums."""
    r = [1, *ranks, 1]
    num_cores = len(p)
    blocks = [
        np.asarray(c, np.float64).reshape(p[k], r[k], q[k], r[k + 1]) for k, c in enumerate(cores)
    ]
    out = np.zeros((num_rows, math.prod(q)))
    for i in range(num_rows):
        digits, rest = [], i
        for k in reversed(range(num_cores)):
            digits.insert(0, rest % p[k])
            rest //= p[k]
        for col, js in enumerate(itertools.product(*[range(n) for n in q])):
            total = 0.0
            for path in itertools.product(*[range(n) for n in r[1:-1]]):
                a = (0, *path, 0)
                term = 1.0
                for k in range(num_cores):
                    term *= blocks[k][digits[k], a[k], js[k], a[k + 1]]
                total += term
            out[i, col] = total
    return out


def random_cores(rng, p, q, ranks, num_tables=1, dtype=np.float64):
    r = [1, *ranks, 1]
    return [
        rng.standard_normal((num_tables * p[k], r[k] * q[k] * r[k + 1])).astype(dtype)
        for k in range(len(p))
    ]


def excess_kurtosis(x):
    x = np.asarray(x, np.float64).ravel()
    x = x - x.mean()
    return float(np.mean(x**4) / np.mean(x**2) ** 2 - 3.0)


def test_docstring_examples_run():
    result = doctest.testmod(tt, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10 and result.failed == 0


# --------------------------------------------------------------------------------------
# suggested_shapes
# --------------------------------------------------------------------------------------

PRIMES = [2, 3, 97, 101, 7919, 104_729, 1_000_003]
SIZES = [1, 2, 5, 10, 64, 100, 999, 1000, 1001, 4096, 65_537, 123_456, 10_000_000, 10_131_227]


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("n", sorted(SIZES + PRIMES))
def test_suggested_shapes_rows(n, d):
    f = tt.suggested_shapes(n, d)
    assert len(f) == d and all(isinstance(x, int) for x in f)
    assert f == sorted(f) and f[0] >= 1
    assert math.prod(f) >= n
    c = n ** (1.0 / d)
    top = math.ceil(c - 1e-9)
    top += top**d < n
    # Never a larger excess than the trivially balanced [ceil(c)] * d ...
    assert math.prod(f) - n <= top**d - n
    # ... and near-balanced: every factor within the documented window around c.
    assert math.floor(c / 1.25) <= f[0] and f[-1] <= max(top, math.ceil(1.25 * c))


def _window_optimum(n, d):
    """Brute force over all sorted tuples in the documented window."""
    c = n ** (1.0 / d)
    top = math.ceil(c - 1e-9)
    top += top**d < n
    lo, hi = max(1, math.floor(c / 1.25)), max(top, math.ceil(1.25 * c))
    best = None
    for f in itertools.combinations_with_replacement(range(lo, hi + 1), d):
        if math.prod(f) >= n:
            key = (math.prod(f) - n, f[-1] - f[0])
            best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 12, 97, 255, 500, 1001, 2023, 4999])
def test_suggested_shapes_rows_optimal_in_window(n, d):
    f = tt.suggested_shapes(n, d)
    assert (math.prod(f) - n, f[-1] - f[0]) == _window_optimum(n, d)


def test_suggested_shapes_rows_known():
    assert tt.suggested_shapes(1, 3) == [1, 1, 1]
    assert tt.suggested_shapes(1000, 3) == [10, 10, 10]
    assert tt.suggested_shapes(10**12, 4) == [1000] * 4
    big = tt.suggested_shapes(10_131_227, 3)
    assert math.prod(big) - 10_131_227 < 100  # FBTT's [200, 220, 250] wastes 8.6%


@pytest.mark.parametrize(
    ("n", "d", "expected"),
    [
        (1, 3, [1, 1, 1]),
        (3, 3, [1, 1, 3]),
        (33, 3, [1, 3, 11]),
        (64, 3, [4, 4, 4]),
        (128, 3, [4, 4, 8]),
        (1000, 3, [10, 10, 10]),
        (97, 3, [1, 1, 97]),
        (128, 2, [8, 16]),
        (64, 4, [2, 2, 4, 4]),
        (97, 2, [1, 97]),
        (12, 2, [3, 4]),
    ],
)
def test_suggested_shapes_exact_known(n, d, expected):
    assert tt.suggested_shapes(n, d, exact=True) == expected


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 3, 16, 33, 60, 64, 96, 97, 128, 360, 1000, 1024, 4096, 7919])
def test_suggested_shapes_exact_most_balanced(n, d):
    f = tt.suggested_shapes(n, d, exact=True)
    assert math.prod(f) == n and f == sorted(f) and len(f) == d
    divisors = [x for x in range(1, n + 1) if n % x == 0]
    spreads = [
        max(g) - min(g)
        for g in itertools.combinations_with_replacement(divisors, d)
        if math.prod(g) == n
    ]
    assert f[-1] - f[0] == min(spreads)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"n": -5}, "n must be an integer >= 1, got -5"),
        ({"n": 2.5}, "n must be an integer >= 1, got 2.5"),
        ({"n": True}, "n must be an integer >= 1, got True"),
        ({"n": 10, "d": 1}, "d must be an integer >= 2, got 1"),
        ({"n": 10, "d": 0, "exact": True}, "d must be an integer >= 2, got 0"),
    ],
)
def test_suggested_shapes_validation(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tt.suggested_shapes(**kwargs)


# --------------------------------------------------------------------------------------
# resolve_shapes, num_parameters, flops_per_lookup
# --------------------------------------------------------------------------------------


def test_resolve_shapes_fills_in():
    assert tt.resolve_shapes(10_131_227, 64, 32) == (
        tt.suggested_shapes(10_131_227, 3),
        [4, 4, 4],
        [32, 32],
    )
    assert tt.resolve_shapes(1000, 16, [3, 5, 7]) == (
        tt.suggested_shapes(1000, 4),
        [2, 2, 2, 2],
        [3, 5, 7],
    )
    assert tt.resolve_shapes(1000, 128, 4, tt_p_shapes=[40, 25]) == ([40, 25], [8, 16], [4])
    assert tt.resolve_shapes(1000, 128, 4, tt_q_shapes=[2, 4, 4, 4]) == (
        tt.suggested_shapes(1000, 4),
        [2, 4, 4, 4],
        [4, 4, 4],
    )
    p, q, r = tt.resolve_shapes(np.int64(77), np.int32(6), (np.int64(2),), [7, 11], [3, 2])
    assert (p, q, r) == ([7, 11], [3, 2], [2]) and all(type(x) is int for x in p + q + r)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (13, 4, 2, [3, 4], [2, 2]),
            "prod(tt_p_shapes) = 12 must be >= num_embeddings = 13, got tt_p_shapes=[3, 4]",
        ),
        (
            (12, 6, 2, [3, 4], [2, 2]),
            "prod(tt_q_shapes) = 4 must equal embedding_dim = 6, got tt_q_shapes=[2, 2]",
        ),
        (
            (12, 8, 2, [3, 4], [2, 2, 2]),
            "tt_p_shapes and tt_q_shapes must have the same length, "
            "got [3, 4] (2 cores) and [2, 2, 2] (3 cores)",
        ),
        ((12, 8, [2, 3], [3, 4], None), "tt_ranks must have 1 entries for 2 cores, got [2, 3]"),
        ((12, 8, [2, 3], None, None), None),  # 3 cores from the ranks: valid
        ((0, 8, 2), "num_embeddings must be an integer >= 1, got 0"),
        ((12, -1, 2), "embedding_dim must be an integer >= 1, got -1"),
        ((12.0, 8, 2), "num_embeddings must be an integer >= 1, got 12.0"),
        ((12, 8, 0), "tt_ranks must be a positive integer or a list of them, got 0"),
        ((12, 8, [2, 0]), "tt_ranks must be a positive integer or a list of them, got [2, 0]"),
        ((12, 8, 2.5), "tt_ranks must be a positive integer or a list of them, got 2.5"),
        ((12, 8, 2, [3, 0, 4]), "tt_p_shapes must be a list of positive integers, got [3, 0, 4]"),
        (
            (12, 8, 2, None, [2, 4.0]),
            "tt_q_shapes must be a list of positive integers, got [2, 4.0]",
        ),
        ((12, 8, 2, [12]), "a TT table needs at least 2 cores, got 1"),
        ((12, 8, [], None, None), "tt_ranks must be a positive integer or a list of them, got []"),
    ],
)
def test_resolve_shapes_validation(args, message):
    if message is None:
        assert tt.resolve_shapes(*args)[2] == [2, 3]
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        tt.resolve_shapes(*args)


def test_num_parameters_and_flops():
    # The anchors' Criteo example: 958,720 floats and ~37 KFLOP per lookup.
    assert tt.num_parameters([200, 220, 250], [4, 4, 4], [32, 32]) == 958_720
    assert tt.flops_per_lookup([4, 4, 4], [32, 32]) == 36_864
    assert tt.num_parameters([200, 220, 250], [4, 4, 4], 32) == 958_720  # one int: all ranks
    assert tt.flops_per_lookup([4, 4, 4], 32) == 36_864
    # Two cores: one (q_0 x r_1) @ (r_1 x q_1) product.
    assert tt.flops_per_lookup([2, 3], [5]) == 2 * 2 * 5 * 3
    assert tt.flops_per_lookup([1, 2, 3, 4], [5, 6, 7]) == 2 * (
        1 * 5 * 2 * 6 + 2 * 6 * 3 * 7 + 6 * 7 * 4 * 1
    )


@pytest.mark.parametrize(
    ("p", "q", "ranks"),
    [
        ([7, 5], [3, 2], [4]),
        ([3, 5, 4], [2, 3, 1], [2, 5]),
        ([2, 3, 2, 3], [1, 2, 3, 2], [3, 1, 4]),
    ],
)
def test_num_parameters_counts_the_cores(p, q, ranks):
    cores = tt.initial_cores(math.prod(p), math.prod(q), p, q, ranks, "normal", seed=0)
    assert tt.num_parameters(p, q, ranks) == sum(c.size for c in cores)


# --------------------------------------------------------------------------------------
# to_dense and rows
# --------------------------------------------------------------------------------------

SHAPES = [
    # (p, q, ranks, N): N never a product of p
    ([7, 5], [3, 2], [4], 31),
    ([2, 9], [1, 5], [1], 17),
    ([3, 5, 4], [2, 3, 1], [2, 5], 53),
    ([4, 1, 3], [3, 1, 2], [3, 2], 11),
    ([2, 3, 2, 3], [1, 2, 3, 2], [3, 1, 4], 35),
    ([3, 2, 2, 2], [2, 2, 1, 3], [2, 3, 2], 23),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("p", "q", "ranks", "n"), SHAPES)
def test_to_dense_matches_slow_loop(rng, p, q, ranks, n, dtype):
    cores = random_cores(rng, p, q, ranks, dtype=dtype)
    dense = tt.to_dense(cores, p, q, ranks, n)
    assert dense.shape == (n, math.prod(q)) and dense.dtype == dtype
    expected = slow_table(cores, p, q, ranks, n)
    tol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(dense, expected, rtol=tol, atol=tol * np.abs(expected).max())
    full = tt.to_dense(cores, p, q, ranks)
    assert full.shape == (math.prod(p), math.prod(q))
    np.testing.assert_array_equal(full[:n], dense)


@pytest.mark.parametrize(("p", "q", "ranks", "n"), SHAPES)
def test_rows_match_to_dense(rng, p, q, ranks, n):
    cores = random_cores(rng, p, q, ranks)
    dense = tt.to_dense(cores, p, q, ranks)
    ids = rng.integers(0, math.prod(p), size=(4, 7))  # unsorted, with duplicates
    ids[0, :3] = ids[1, 2]
    got = tt.rows(cores, p, q, ranks, ids)
    assert got.shape == (4, 7, math.prod(q)) and got.dtype == np.float64
    np.testing.assert_allclose(got, dense[ids], rtol=1e-12, atol=1e-12 * np.abs(dense).max())
    assert tt.rows(cores, p, q, ranks, np.zeros(0, np.int64)).shape == (0, math.prod(q))


@pytest.mark.parametrize(("p", "q", "ranks", "n"), SHAPES[::2])
def test_rows_and_to_dense_several_tables(rng, p, q, ranks, n):
    num_tables = 3
    cores = random_cores(rng, p, q, ranks, num_tables=num_tables, dtype=np.float32)
    big_p = math.prod(p)
    ids = rng.integers(0, num_tables * big_p, size=40)
    got = tt.rows(cores, p, q, ranks, ids, num_tables=num_tables)
    assert got.dtype == np.float32
    for t in range(num_tables):
        table_cores = [c[t * pk : (t + 1) * pk] for c, pk in zip(cores, p, strict=True)]
        dense = tt.to_dense(cores, p, q, ranks, n, num_tables=num_tables, table=t)
        np.testing.assert_array_equal(dense, tt.to_dense(table_cores, p, q, ranks, n))
        mine = ids // big_p == t
        expected = slow_table(table_cores, p, q, ranks, big_p)[ids[mine] % big_p]
        np.testing.assert_allclose(
            got[mine], expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max()
        )


def test_result_dtypes(rng):
    p, q, ranks = [3, 4], [2, 2], [3]
    c64 = random_cores(rng, p, q, ranks)
    mixed = [c64[0], c64[1].astype(np.float32)]
    assert tt.to_dense(c64, p, q, ranks).dtype == np.float64
    assert tt.to_dense(mixed, p, q, ranks).dtype == np.float32
    assert tt.rows(mixed, p, q, ranks, [1, 2]).dtype == np.float32
    assert tt.rows(mixed, p, q, ranks, [1, 2], dtype=np.float64).dtype == np.float64
    assert tt.to_dense([c.astype(np.float16) for c in c64], p, q, ranks).dtype == np.float32


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: tt.rows(c, [3, 4], [2, 2], [3], [0, 5, 12, 1]), "ids[2] = 12 is not in [0, 12)"),
        (
            lambda c: tt.rows(c, [3, 4], [2, 2], [3], [[0, 1], [-1, 2]]),
            "ids[2] = -1 is not in [0, 12)",
        ),
        (
            lambda c: tt.rows(c, [3, 4], [2, 2], [3], [1.0]),
            "ids must be integers, got dtype float64",
        ),
        (
            lambda c: tt.rows(c, [3, 4], [2, 2], [3], [1], num_tables=2),
            "cores[0] has shape (3, 6), expected (6, 6)",
        ),
        (
            lambda c: tt.rows(c, [3, 4], [2, 2], [2], [1]),
            "cores[0] has shape (3, 6), expected (3, 4)",
        ),
        (
            lambda c: tt.rows(c[:1], [3, 4], [2, 2], [3], [1]),
            "expected 2 cores for p_shapes=[3, 4], got 1",
        ),
        (
            lambda c: tt.to_dense(c, [3, 4], [2, 2], [3], 13),
            "num_embeddings = 13 must be <= prod(p_shapes) = 12",
        ),
        (lambda c: tt.to_dense(c, [3, 4], [2, 2], [3], table=1), "table must be in [0, 1), got 1"),
        (
            lambda c: tt.to_dense(c, [3, 4], [2, 2], [3, 1]),
            "need T >= 2 cores with len(p_shapes) == len(q_shapes) == len(ranks) + 1",
        ),
    ],
)
def test_expansion_validation(rng, call, message):
    cores = random_cores(rng, [3, 4], [2, 2], [3])
    with pytest.raises(ValueError, match=re.escape(message)):
        call(cores)


# --------------------------------------------------------------------------------------
# from_dense (TT-SVD)
# --------------------------------------------------------------------------------------


def _max_ranks(p, q):
    modes = [a * b for a, b in zip(p, q, strict=True)]
    return [min(math.prod(modes[: k + 1]), math.prod(modes[k + 1 :])) for k in range(len(p) - 1)]


@pytest.mark.parametrize(("p", "q", "ranks", "n"), SHAPES)
def test_from_dense_full_rank_is_exact(rng, p, q, ranks, n):
    a = rng.standard_normal((n, math.prod(q))) * rng.uniform(0.5, 3.0)
    dec = tt.from_dense(a, 10_000, p, q)
    assert dec.p_shapes == p and dec.q_shapes == q
    assert dec.ranks == _max_ranks(p, q)
    assert all(c.dtype == np.float64 for c in dec.cores)
    assert dec.relative_error < 1e-10
    back = tt.to_dense(dec.cores, p, q, dec.ranks, n)
    np.testing.assert_allclose(back, a, rtol=0, atol=1e-10 * np.abs(a).max())
    np.testing.assert_allclose(
        back, slow_table(dec.cores, p, q, dec.ranks, n), rtol=1e-12, atol=1e-12
    )


def test_from_dense_float32_and_default_shapes(rng):
    a = rng.standard_normal((300, 12)).astype(np.float32)
    dec = tt.from_dense(a, 1000)
    assert (dec.p_shapes, dec.q_shapes) == (
        tt.suggested_shapes(300, 3),
        tt.suggested_shapes(12, 3, exact=True),
    )
    assert all(c.dtype == np.float32 for c in dec.cores)
    assert dec.relative_error < 1e-5
    dec2 = tt.from_dense(a, [2, 3, 4], None, [1, 2, 2, 3])
    assert len(dec2.cores) == 4 and dec2.ranks == [2, 3, 4]


@pytest.mark.parametrize(
    ("p", "q"), [([8, 9, 7], [2, 4, 2]), ([9, 11], [3, 4]), ([5, 4, 6, 3], [2, 1, 3, 2])]
)
def test_from_dense_error_decreases_with_rank(rng, p, q):
    n = math.prod(p) - 3
    # A table with a decaying spectrum: a smooth part plus noise.
    u = rng.standard_normal((n, 6)) * np.array([8.0, 4.0, 2.0, 1.0, 0.5, 0.25])
    a = u @ rng.standard_normal((6, math.prod(q))) + 0.05 * rng.standard_normal((n, math.prod(q)))
    errors = []
    for r in [1, 2, 3, 4, 6, 8, 12, 16, 32, 1000]:
        dec = tt.from_dense(a, r, p, q)
        approx = tt.to_dense(dec.cores, p, q, dec.ranks, n)
        exact_error = np.linalg.norm(a - approx) / np.linalg.norm(a)
        assert dec.relative_error == pytest.approx(exact_error, rel=1e-9, abs=1e-13)
        assert all(rk <= min(r, m) for rk, m in zip(dec.ranks, _max_ranks(p, q), strict=True))
        errors.append(dec.relative_error)
    assert 0.05 < errors[0] < 1.0
    assert all(e2 <= e1 * (1 + 1e-9) + 1e-13 for e1, e2 in zip(errors, errors[1:], strict=False))
    assert errors[-1] < 1e-10


@pytest.mark.parametrize(
    ("p", "q", "ranks"),
    [
        ([6, 7], [4, 3], [3]),
        ([4, 5, 6], [2, 3, 2], [3, 4]),
        ([3, 4, 3, 4], [2, 2, 2, 2], [2, 4, 3]),
    ],
)
def test_from_dense_recovers_planted_tt(rng, p, q, ranks):
    planted = random_cores(rng, p, q, ranks)
    a = tt.to_dense(planted, p, q, ranks)
    exact = tt.from_dense(a, ranks, p, q)
    assert exact.ranks == ranks
    assert exact.relative_error < 1e-10
    low = tt.from_dense(a, [max(1, r - 1) for r in ranks], p, q)
    assert low.relative_error > 1e-3


def test_from_dense_zero_and_validation():
    dec = tt.from_dense(np.zeros((6, 4)), 2, [2, 3], [2, 2])
    assert dec.relative_error == 0.0
    with pytest.raises(
        ValueError, match=re.escape("matrix must be a non-empty 2-D array [N, D], got shape (6,)")
    ):
        tt.from_dense(np.arange(6.0), 2)
    with pytest.raises(
        ValueError, match=re.escape("prod(tt_p_shapes) = 4 must be >= num_embeddings = 6")
    ):
        tt.from_dense(np.ones((6, 4)), 2, [2, 2], [2, 2])


# --------------------------------------------------------------------------------------
# initial_cores
# --------------------------------------------------------------------------------------


def test_initial_cores_shapes_dtypes_seeds():
    p, q, ranks = [5, 6, 7], [2, 3, 2], [3, 4]
    for dist in tt.WEIGHT_DISTS:
        cores = tt.initial_cores(200, 12, p, q, ranks, dist, seed=3, num_tables=4)
        assert [c.shape for c in cores] == [(20, 6), (24, 36), (28, 8)]
        assert all(c.dtype == np.float32 for c in cores)
        again = tt.initial_cores(
            200, 12, p, q, ranks, dist, seed=np.random.default_rng(3), num_tables=4
        )
        for c, d in zip(cores, again, strict=True):
            np.testing.assert_array_equal(c, d)
        other = tt.initial_cores(200, 12, p, q, ranks, dist, seed=4, num_tables=4)
        assert not np.array_equal(cores[1], other[1])
        # Independent tables: no two tables share a core.
        for c, pk in zip(cores, p, strict=True):
            tables = c.reshape(4, pk, -1)
            assert all(
                not np.array_equal(tables[i], tables[j])
                for i, j in itertools.combinations(range(4), 2)
            )
    c64 = tt.initial_cores(200, 12, p, q, 2, seed=0, dtype=np.float64)
    assert [c.dtype for c in c64] == [np.float64] * 3 and [c.shape for c in c64] == [
        (5, 4),
        (6, 12),
        (7, 4),
    ]
    assert tt.initial_cores(200, 12, p, q, 2, seed=0, dtype="float16")[0].dtype == np.float16


def test_initial_cores_validation():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "weight_dist must be one of 'approx-uniform', 'approx-normal', 'uniform', "
            "'normal', 'naive-uniform', got 'gaussian'"
        ),
    ):
        tt.initial_cores(100, 8, [10, 10], [2, 4], [2], "gaussian")
    with pytest.raises(
        ValueError, match=re.escape("prod(tt_q_shapes) = 8 must equal embedding_dim = 16")
    ):
        tt.initial_cores(100, 16, [10, 10], [2, 4], [2])
    with pytest.raises(ValueError, match=re.escape("dtype must be a float dtype, got int32")):
        tt.initial_cores(100, 8, [10, 10], [2, 4], [2], dtype=np.int32)
    with pytest.raises(ValueError, match=re.escape("num_tables must be an integer >= 1, got 0")):
        tt.initial_cores(100, 8, [10, 10], [2, 4], [2], num_tables=0)


@pytest.mark.parametrize("dist", ["approx-uniform", "approx-normal"])
def test_approx_cores_use_the_full_ranks(dist):
    # Different rows take different rank components: every unfolding has the full TT rank.
    p, q, ranks = [6, 5, 7], [2, 3, 2], [3, 4]
    cores = tt.initial_cores(200, 12, p, q, ranks, dist, seed=1, dtype=np.float64)
    tensor = tt.to_dense(cores, p, q, ranks).reshape(*p, *q).transpose(0, 3, 1, 4, 2, 5)
    assert np.linalg.matrix_rank(tensor.reshape(p[0] * q[0], -1)) == ranks[0]
    assert np.linalg.matrix_rank(tensor.reshape(-1, p[2] * q[2])) == ranks[1]


# Table-level statistics: 2,000 rows sampled with `rows` (never the full table). Shapes:
# (N, D, number of cores, ranks); p and q from resolve_shapes.
STAT_CONFIGS = [
    (10_000_000, 64, 3, [32, 32]),  # p = [200, 200, 250], q = [4, 4, 4]: Criteo-sized
    (10_000_000, 16, 4, [8, 8, 8]),
    (10_000_000, 128, 2, [1]),
    (10_131_227, 64, 3, [2, 2]),
    (1_000_000, 64, 3, [1, 1]),
    (100_000, 32, 3, [4, 4]),
    (5_000, 16, 2, [16]),
]


def _stat_sample(rng, dist, n, dim, num_cores, ranks):
    p, q, ranks = tt.resolve_shapes(n, dim, ranks, tt.suggested_shapes(n, num_cores))
    cores = tt.initial_cores(n, dim, p, q, ranks, dist, seed=int(rng.integers(2**31)))
    return tt.rows(cores, p, q, ranks, rng.integers(0, n, 2000), dtype=np.float64), ranks


@pytest.mark.parametrize(
    "config", STAT_CONFIGS, ids=lambda c: f"N{c[0]}-D{c[1]}-T{c[2]}-r{c[3][0]}"
)
@pytest.mark.parametrize("dist", ["approx-uniform", "approx-normal", "uniform", "normal"])
def test_initial_cores_table_statistics(rng, dist, config):
    n = config[0]
    x, ranks = _stat_sample(rng, dist, *config)
    sigma = 1.0 / math.sqrt(3 * n)
    # Tolerances: 10 seeds per configuration were measured (see initial_cores' docstring);
    # each bound here is at least twice the largest deviation seen there. Entries of one
    # table are far from independent (they share core entries), hence the wide bounds.
    assert abs(x.mean()) < 0.05 * sigma  # seen: < 0.015 sigma
    assert abs(np.mean(x > 0) - 0.5) < 0.02  # seen: < 0.008
    if dist.startswith("approx"):
        assert abs(x.std() / sigma - 1) < 0.10  # seen: < 0.03
        if dist == "approx-uniform":
            assert np.abs(x).max() <= 1.0 / math.sqrt(n) * (1 + 1e-12)  # the support, exactly
            assert abs(excess_kurtosis(x) + 1.2) < 0.15  # seen: -1.24 .. -1.15
        else:
            assert abs(excess_kurtosis(x)) < 0.30  # seen: -0.10 .. +0.15
    elif math.prod(ranks) >= 16:
        # i.i.d. cores: the variance is right in law, but one table of small ranks has
        # heavy tails and its std fluctuates by up to 13% (seen at ranks [1, 1]); with
        # prod(ranks) >= 16 it stays within 6%. The law itself is tested below.
        assert abs(x.std() / sigma - 1) < 0.10


@pytest.mark.parametrize(
    "config", STAT_CONFIGS[::2], ids=lambda c: f"N{c[0]}-D{c[1]}-T{c[2]}-r{c[3][0]}"
)
def test_naive_uniform_is_the_naive_baseline(rng, config):
    n, dim, num_cores, ranks = config
    x, ranks = _stat_sample(rng, "naive-uniform", *config)
    assert (x > 0).all()
    # mean = prod(ranks) E[U(0, 1/sqrt(N))]^T, with 2,000 rows well within 10%.
    expected = math.prod(ranks) * (0.5 / math.sqrt(n)) ** num_cores
    assert x.mean() == pytest.approx(expected, rel=0.1)


def _law_sample(dist, num_cores, count, seed):
    """`count` i.i.d. entries: entry (5, 3) of `count` independent tables, in units of sigma."""
    p, q, ranks = [2] * (num_cores - 1) + [3], [2] * num_cores, [3] * (num_cores - 1)
    n = math.prod(p)
    cores = tt.initial_cores(n, 2**num_cores, p, q, ranks, dist, seed=seed, num_tables=count)
    x = tt.rows(cores, p, q, ranks, np.arange(count) * n + 5, num_tables=count, dtype=np.float64)
    return x[:, 3] * math.sqrt(3 * n)


def _normal_cdf(x):
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@pytest.mark.parametrize("num_cores", [2, 3, 4])
@pytest.mark.parametrize("dist", ["approx-uniform", "approx-normal"])
def test_approx_entries_follow_the_law_exactly(rng, dist, num_cores):
    count = 10_000
    x = np.sort(_law_sample(dist, num_cores, count, int(rng.integers(2**31))))
    if dist == "approx-uniform":
        cdf = np.clip((x / math.sqrt(3.0) + 1.0) / 2.0, 0.0, 1.0)
        target_kurtosis, kurtosis_sd = -1.2, math.sqrt(1.31 / count)  # Var(g2) ~ 1.31 / n for U
    else:
        cdf = _normal_cdf(x)
        target_kurtosis, kurtosis_sd = 0.0, math.sqrt(24.0 / count)  # Var(g2) ~ 24 / n for N(0, 1)
    # Kolmogorov-Smirnov distance of i.i.d. samples: above 1.95 / sqrt(n) with prob. 0.1%.
    # (The i.i.d. cores of "uniform" / "normal" give 8 to 23 / sqrt(n) here.)
    upper = np.arange(1, count + 1) / count
    ks = max(np.max(upper - cdf), np.max(cdf - (upper - 1.0 / count)))
    assert ks < 1.95 / math.sqrt(count)
    assert abs(excess_kurtosis(x) - target_kurtosis) < 5 * kurtosis_sd
    assert abs(x.std() - 1.0) < 0.03 and abs(x.mean()) < 0.05


@pytest.mark.parametrize("num_cores", [2, 4])
@pytest.mark.parametrize("dist", ["uniform", "normal"])
def test_iid_entries_have_the_target_variance(rng, dist, num_cores):
    x = _law_sample(dist, num_cores, 10_000, int(rng.integers(2**31)))
    # sd of the sample variance is sqrt((kurtosis + 2) / n): bound the std at 5 sd.
    tol = 5 * 0.5 * math.sqrt((excess_kurtosis(x) + 2.0) / len(x))
    assert abs(x.std() - 1.0) < tol
    assert abs(x.mean()) < 5 / math.sqrt(len(x))
