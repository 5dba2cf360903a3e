"""numpy references of the device-side TT row cache, for check_tt_update.py: a model of the
CPU TTCacheCount kernel (cc/kernels/tt_embedding_forward_cpu.cc), bit for bit, and ports of
the layer's cache lookup and populate; and the check of the models against the TF ops
(`check_tt_update.py --crosscheck-cpu-op`: TensorFlow, no GPU). numpy only."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
M64 = (1 << 64) - 1
EMPTY = 2**63 - 1  # an empty cache slot (kEmptyCacheId)


def log(*a):
    print(*a, flush=True)


def mix_id(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return x


def count_ref(keys: np.ndarray, counts: np.ndarray, ids: np.ndarray) -> None:
    """Applies one batch to (keys, counts) in place, as the CPU op does."""
    size = len(keys)
    if size == 0:
        return
    valid = ids[ids >= 0]
    uniq, mult = np.unique(valid, return_counts=True)
    ways = min(32, size)
    num_sets = (size + ways - 1) // ways
    for ident, m in zip(uniq.tolist(), mult.tolist()):
        base = (mix_id(ident) % num_sets) * ways
        end = min(size, base + ways)
        found, empty, smallest = -1, -1, base
        for w in range(base, end):
            if keys[w] == ident:
                found = w
                break
            if keys[w] < 0:
                if empty < 0:
                    empty = w
            elif counts[w] < counts[smallest] or keys[smallest] < 0:
                smallest = w
        if found >= 0:
            counts[found] += m
        elif empty >= 0:
            keys[empty] = ident
            counts[empty] = m
        else:
            keys[smallest] = ident
            counts[smallest] += m


def zipf_ids(
    rng: np.random.Generator, n: int, num_ids: int, a: float = 1.1, pad_frac: float = 0.0
) -> np.ndarray:
    ranks = np.arange(1, num_ids + 1, dtype=np.float64)
    probs = ranks**-a
    probs /= probs.sum()
    perm = rng.permutation(num_ids)
    ids = perm[rng.choice(num_ids, size=n, p=probs)].astype(np.int64)
    if pad_frac and n:
        ids[rng.random(n) < pad_frac] = -1
    return ids


def crosscheck_cpu_op() -> int:
    """The Python model against the TF CPU op (runs where TensorFlow is, no GPU)."""
    import tensorflow as tf  # noqa: F401

    sys.path.insert(0, str(REPO))
    from tf_ttemb.ops import tt_embedding as tte

    rng = np.random.default_rng(7)
    fails = 0
    for size in [1, 5, 32, 33, 100, 1000, 4099]:
        keys_v = tf.Variable(np.full(size, -1, np.int64))
        counts_v = tf.Variable(np.zeros(size, np.int64))
        keys, counts = keys_v.numpy().copy(), counts_v.numpy().copy()
        for batch in range(6):
            ids = zipf_ids(rng, int(rng.integers(0, 3000)), 20 * size + 7, pad_frac=0.1)
            tte._count((keys_v, counts_v), tf.constant(ids), False)
            count_ref(keys, counts, ids)
            same = np.array_equal(keys, keys_v.numpy()) and np.array_equal(counts, counts_v.numpy())
            fails += not same
            log(
                f"crosscheck H={size:5d} batch {batch}: n={len(ids):5d} "
                f"{'equal' if same else 'DIFFERENT'}"
            )
    # cache_populate of the layer against populate_ref (ids, and which rows stay).
    from tf_ttemb.layers import TTEmbeddingBag

    for table, c in [(64, 16), (1000, 100), (300, 300)]:
        layer = TTEmbeddingBag(
            997,
            8,
            tt_ranks=3,
            use_cache=True,
            cache_size=c,
            hashtbl_size=table,
            seed=3,
            implementation="custom_op",
        )
        layer.build()
        keys = rng.integers(0, 997, table).astype(np.int64)
        keys = np.unique(keys)
        keys = np.concatenate([keys, np.full(table - len(keys), -1, np.int64)])
        rng.shuffle(keys)
        counts = rng.integers(0, 5, table).astype(np.int64)
        old = np.sort(rng.choice(997, size=c // 2, replace=False)).astype(np.int64)
        old_ids = np.concatenate([old, np.full(c - len(old), EMPTY, np.int64)])
        markers = rng.normal(size=(c, 8)).astype(np.float32)
        layer.freq_keys.assign(keys)
        layer.freq_counts.assign(counts)
        layer.cache_ids.assign(old_ids)
        layer.cache_rows.assign(markers)
        layer.cache_populate()
        ref = populate_ref(keys, counts, old_ids, 0)
        new_rows = layer.cache_rows.numpy()
        stays = ref["src"] >= 0
        same = (
            np.array_equal(layer.cache_ids.numpy(), ref["new_ids"])
            and np.array_equal(new_rows[stays], markers[ref["src"][stays]])
            and np.all(new_rows[ref["new_ids"] == EMPTY] == 0)
            and not np.any(
                np.all(new_rows[ref["fresh_rank"] >= 0][:, None, :] == markers[None, :, :], axis=2)
            )
        )
        fails += not same
        log(
            f"crosscheck populate H={table} C={c}: stay {int(stays.sum())}, fresh "
            f"{int(ref['num_fresh'][0])}: {'equal' if same else 'DIFFERENT'}"
        )
    log("PASSED" if not fails else "FAILED")
    return 1 if fails else 0


# ---------------------------------------------------------------------------
# Everything below needs torch with a GPU and the harness library.


def lookup_ref(ids, cache_ids, pad):
    ids, cache_ids = np.asarray(ids), np.asarray(cache_ids)
    n, c = len(ids), len(cache_ids)
    valid = (ids >= 0) & (ids != EMPTY)
    if c:
        pos = np.minimum(np.searchsorted(cache_ids, ids, side="left"), c - 1)
        hit = valid & (cache_ids[pos] == ids)
    else:
        pos, hit = np.zeros(n, np.int64), np.zeros(n, bool)
    miss = valid & ~hit
    position = np.where(hit, pos, -1)
    miss_rank = np.where(miss, np.cumsum(miss) - 1, -1)
    hit_at, miss_at = np.nonzero(hit)[0], np.nonzero(miss)[0]

    def fill(a, v):
        return np.concatenate([a, np.full(n - len(a), v, np.int64)]).astype(np.int64)

    return {
        "position": position.astype(np.int64),
        "miss_rank": miss_rank.astype(np.int64),
        "miss_ids": fill(ids[miss_at], pad),
        "miss_at": fill(miss_at, -1),
        "hit_at": fill(hit_at, -1),
        "hit_pos": fill(position[hit_at], -1),
        "counts": np.array([len(hit_at), len(miss_at)], np.int64),
    }


def populate_ref(keys, counts, old_ids, pad):
    """numpy port of the layer's cache_populate (ids part)."""
    size = len(old_ids)
    live = (keys >= 0) & (counts > 0)
    k, c = keys[live], counts[live]
    by_id = np.argsort(k, kind="stable")
    k, c = k[by_id], c[by_id]
    by_count = np.argsort(-c, kind="stable")
    chosen = np.sort(k[by_count][:size])
    new_ids = np.concatenate([chosen, np.full(size - len(chosen), EMPTY, np.int64)])
    position = np.minimum(np.searchsorted(old_ids, new_ids, side="left"), size - 1)
    real = new_ids != EMPTY
    stays = real & (old_ids[position] == new_ids)
    fresh = real & ~stays
    fresh_at = np.nonzero(fresh)[0]

    def fill(a, v):
        return np.concatenate([a, np.full(size - len(a), v, np.int64)]).astype(np.int64)

    return {
        "new_ids": new_ids.astype(np.int64),
        "src": np.where(stays, position, -1).astype(np.int64),
        "fresh_rank": np.where(fresh, np.cumsum(fresh) - 1, -1).astype(np.int64),
        "fresh_ids": fill(new_ids[fresh_at], pad),
        "fresh_at": fill(fresh_at, -1),
        "num_fresh": np.array([len(fresh_at)], np.int64),
    }
