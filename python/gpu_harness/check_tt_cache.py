"""gpu_check.py sections "tt_cache" (the TT forward with the device-side row cache) and
"tt_zipf" (issue 5's Zipf target along the TF GPU ops' host-sizes path)."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_common as common  # noqa: E402
import harness as gh  # noqa: E402
import harness_cache as ghc  # noqa: E402
from check_tt import (  # noqa: E402
    TT_CONFIGS,
    tt_bench_fields,
    tt_bench_inputs,
    tt_call_kwargs,
    tt_make_case,
    tt_reference,
    tt_rows_torch,
)

TT_CACHE_CONFIGS = [
    "2core",
    "3core-zipf",
    "4core-odd-pad",
    "q-ones-odd-ranks",
    "N<prodp-pad",
    "tables-pad",
    "empty-bags",
    "hot-zipf-long",
]
TT_CACHE_SMALL = ["3core-zipf", "4core-odd-pad", "tables-pad", "empty-bags"]


def tt_cache_populate_case(c, frac, seed):
    """Counts the batch's global ids and a batch of other valid ids into a frequency table
    (2x the cache), then populates a cache of about frac x the batch's distinct ids the
    layer's way (count, populate, TT rows of the fresh ids, select)."""
    gids = c["gids"]
    P = math.prod(c["p"])
    M = c["tables"] * P
    distinct = int(torch.unique(gids[gids >= 0]).numel())
    size = max(1, int(round(frac * distinct)))
    table = max(2 * size, 8)
    keys = torch.full((table,), -1, dtype=torch.int64, device=common.DEVICE)
    counts = torch.zeros(table, dtype=torch.int64, device=common.DEVICE)
    gen = torch.Generator().manual_seed(seed + 77)
    n_extra = max(8, gids.numel() // 2)
    extra = torch.randint(0, c["tables"], (n_extra,), generator=gen) * P + torch.randint(
        0, c["n_emb"], (n_extra,), generator=gen
    )
    ghc.tt_cache_count(gids.to(common.DEVICE), keys, counts, M)
    ghc.tt_cache_count(extra.to(common.DEVICE), keys, counts, M)
    shape = gh.TTShape(c["p"], c["q"], c["ranks"], c["tables"])
    cache_ids, cache_rows, _ = ghc.tt_cache_fill(shape, c["cores"], keys, counts, size)
    return cache_ids, cache_rows


def tt_cache_check_case(config, dtype, itype, combiner, weighted, seed, frac):
    c = tt_make_case(config, dtype, itype, combiner, weighted, seed)
    res = {
        "section": "tt_cache",
        "config": config[0],
        "dtype": common.SHORT[dtype],
        "itype": common.SHORT[itype],
        "combiner": combiner,
        "weighted": weighted,
        "frac": frac,
        "failures": [],
        "worst": {},
    }
    fail = res["failures"]
    cache_ids, cache_rows = tt_cache_populate_case(c, frac, seed)
    args = (c["cores"], c["p"], c["q"], c["ranks"], c["ids"], c["offsets"])
    kw = tt_call_kwargs(c)
    out_c, st = ghc.tt_embedding_bag_forward_cached(*args, cache_ids, cache_rows, **kw)
    out_u, st_u = gh.tt_embedding_bag_forward(*args, **kw)
    ref = tt_reference(c, out_kernel=out_c)
    common.check_close(
        res, "forward_vs_f64", "forward vs f64", out_c, ref["out"], ref["out_abs"], dtype
    )
    common.check_close(
        res,
        "forward_vs_uncached",
        "forward vs uncached",
        out_c,
        out_u.detach().cpu().double(),
        ref["out_abs"],
        dtype,
    )
    res["bitwise_vs_uncached"] = bool(torch.equal(common.bits(out_c), common.bits(out_u)))
    # The cache: its rows are the TT rows of its ids (float64 from the cores), empty slots 0.
    cids = cache_ids.cpu()
    held = cids != ghc.EMPTY_CACHE_ID
    if bool((cids[held][1:] <= cids[held][:-1]).any()) or bool(held[int(held.sum()) :].any()):
        fail.append("cache ids not sorted / empty slots not at the end")
    cores64 = [x.detach().cpu().double() for x in c["cores"]]
    want = tt_rows_torch(cores64, c["p"], c["q"], c["r"], c["tables"], cids[held])
    want_abs = tt_rows_torch(
        [x.abs() for x in cores64], c["p"], c["q"], c["r"], c["tables"], cids[held]
    )
    common.check_close(
        res,
        "cache_rows_vs_f64",
        "cache rows",
        cache_rows[held.to(cache_rows.device)],
        want,
        want_abs,
        dtype,
    )
    if not bool((cache_rows[(~held).to(cache_rows.device)] == 0).all()):
        fail.append("empty cache slots not zero")
    # Hits and misses (device counts) against the unique ids found in the cache.
    u = int(st.num_unique.item())
    uniq = st.unique[:u].cpu()
    if not torch.equal(uniq, ref["unique"]):
        fail.append("unique ids")
    if not bool((st.unique[u:] == ghc.EMPTY_CACHE_ID).all()):
        fail.append("unique ids tail not EMPTY_CACHE_ID")
    hits = int(torch.isin(uniq, cids[held]).sum())
    counts = st.lookup["counts"].cpu().tolist()
    res.update(
        unique=u,
        cache_size=int(cids.numel()),
        cached=int(held.sum()),
        hits=counts[0],
        misses=counts[1],
    )
    if counts != [hits, u - hits]:
        fail.append(f"lookup counts {counts}, want {[hits, u - hits]}")
    # The stitched rows equal the uncached TTRows rows (to tolerance).
    if u:
        rows_ref = tt_rows_torch(cores64, c["p"], c["q"], c["r"], c["tables"], uniq)
        rows_abs = tt_rows_torch(
            [x.abs() for x in cores64], c["p"], c["q"], c["r"], c["tables"], uniq
        )
        common.check_close(
            res, "rows_vs_f64", "stitched rows", st.rows[:u], rows_ref, rows_abs, dtype
        )
        res["rows_bitwise_vs_uncached"] = bool(
            torch.equal(common.bits(st.rows[:u]), common.bits(st_u.rows[:u]))
        )
    return res


def tt_cache_sweep(small, max_cases=None):
    names = TT_CACHE_SMALL if small else TT_CACHE_CONFIGS
    configs = [x for x in TT_CONFIGS if x[0] in names]
    dtypes = [torch.bfloat16, torch.float32, torch.float64] if small else common.DTYPES
    combos = [("sum", False), ("mean", True)] + ([] if small else [("sqrtn", False)])
    cases = []
    i = 0
    for config in configs:
        for dtype in dtypes:
            for combiner, weighted in combos:
                frac = (0.5, 1.5, 0.1)[i % 3]
                cases.append(
                    (config, dtype, common.INDEX_DTYPES[(i // 2) % 2], combiner, weighted, frac)
                )
                i += 1

    def check(config, dtype, itype, combiner, weighted, frac, seed):
        return tt_cache_check_case(config, dtype, itype, combiner, weighted, seed, frac)

    def describe(case):
        config, dtype, _, combiner, _, frac = case
        return {
            "section": "tt_cache",
            "config": config[0],
            "dtype": common.SHORT[dtype],
            "combiner": combiner,
            "frac": frac,
        }

    return common.run_cases(cases, check, 3000, describe, "FAIL tt_cache", max_cases)


def _tt_ref_bags64(cores, p, q, r, ids, bags, length, chunk=65536):
    """float64 bag sums (and the same with |cores|) of a single-table batch with fixed-length
    bags, on the GPU: rows of the distinct ids in chunks (the [n, r q r] gathers of all
    lookups would not fit), then index_add per bag. Returns CPU tensors."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    c64 = [x.double() for x in cores]
    outs = []
    for cs in (c64, [x.abs() for x in c64]):
        rows = torch.cat(
            [
                tt_rows_torch(cs, p, q, r, 1, uniq[i : i + chunk])
                for i in range(0, uniq.numel(), chunk)
            ]
        )
        bag_of = torch.arange(ids.numel(), device=ids.device) // length
        out = torch.zeros(bags, rows.shape[1], dtype=torch.float64, device=ids.device)
        outs.append(out.index_add_(0, bag_of, rows[inv]).cpu())
        del rows
    return outs


def tt_cache_bench(counted_batches=4, B_list=(65536, 512), length=20, iters=(20, 50)):
    """The issue's cache target at FBTT's shape (f32, p=[200,220,250], q=[4,4,4], R=[32,32],
    bag 20, sum): Zipf(1.1) ids with one fixed popularity order; a frequency table of 2 x the
    cache counts `counted_batches` batches of B=65,536 x 20 (LaunchCacheCount), then the
    cache (1% of the rows) is populated from it (LaunchCachePopulate, TTRows of the fresh ids,
    select). Fresh batches (not counted) are then looked up with and without the cache."""
    dev = "cuda"
    p, q, ranks = [200, 220, 250], [4, 4, 4], [32, 32]
    r = [1] + ranks + [1]
    N, D = math.prod(p), math.prod(q)
    C = N // 100
    H = 2 * C
    gen = torch.Generator(device=dev).manual_seed(11)
    cores = [
        torch.randn(p[k], r[k] * q[k] * r[k + 1], device=dev, generator=gen) * (1 / r[k]) ** 0.5
        for k in range(len(p))
    ]
    shape = gh.TTShape(p, q, ranks)
    cgen = torch.Generator().manual_seed(13)
    perm = torch.randperm(N, generator=cgen)
    res = {
        "section": "tt_cache",
        "p": p,
        "q": q,
        "ranks": ranks,
        "dtype": "f32",
        "bag_len": length,
        "rows": N,
        "cache_size": C,
        "freq_table": H,
        "counted_batches": counted_batches,
        "counted_batch_lookups": 65536 * length,
        "dist": "zipf(1.1), fixed popularity order",
        "cases": [],
    }
    t0 = time.time()
    keys = torch.full((H,), -1, dtype=torch.int64, device=dev)
    counts = torch.zeros(H, dtype=torch.int64, device=dev)
    for _ in range(counted_batches):
        ghc.tt_cache_count(
            common.make_ids(65536 * length, N, "zipf", torch.int64, cgen, dev, perm),
            keys,
            counts,
            N,
        )
    cache_ids, cache_rows, pop = ghc.tt_cache_fill(shape, cores, keys, counts, C)
    torch.cuda.synchronize()
    held = cache_ids != ghc.EMPTY_CACHE_ID
    res["cached_rows"] = int(held.sum())
    res["cached_in_true_top1pct"] = int(torch.isin(cache_ids[held], perm[:C].to(dev)).sum())
    res["setup_s"] = time.time() - t0
    # Time of filling the cache (populate + TT rows of all fresh ids + select), from empty.
    empty_ids = torch.full((C,), ghc.EMPTY_CACHE_ID, dtype=torch.int64, device=dev)
    empty_rows = torch.zeros(C, D, device=dev)
    common.timed(
        res,
        "populate_from_empty",
        lambda i: ghc.tt_cache_fill(shape, cores, keys, counts, C, empty_ids, empty_rows),
        10,
    )
    common.log(
        f"tt_cache: cache of {res['cached_rows']} rows ({res['cached_in_true_top1pct']} of them "
        f"in the true hottest 1%), populated from {counted_batches} counted batches "
        f"({res['setup_s']:.1f} s); populate from empty "
        f"{common.fmt(res.get('populate_from_empty_ms'))} ms"
    )
    for B, it in zip(B_list, iters):
        nnz = B * length
        sets = [common.make_ids(nnz, N, "zipf", torch.int64, cgen, dev, perm) for _ in range(3)]
        off = torch.arange(0, nnz + 1, length, device=dev)
        splits = torch.tensor([0, nnz], dtype=torch.int64, device=dev)
        row = {"B": B, "lookups": nnz}
        # Correctness at the bench shape (set 0): cached vs uncached vs float64.
        out_c, st = ghc.tt_embedding_bag_forward_cached(
            cores, p, q, ranks, sets[0], off, cache_ids, cache_rows, table_splits=splits, check=True
        )
        out_u, st_u = gh.tt_embedding_bag_forward(
            cores, p, q, ranks, sets[0], off, table_splits=splits, check=True
        )
        ref, ref_abs = _tt_ref_bags64(cores, p, q, r, sets[0], B, length)
        ok1, ratio1 = common.close(out_c, ref, ref_abs, torch.float32)
        ok2, ratio2 = common.close(out_c, out_u.detach().cpu().double(), ref_abs, torch.float32)
        u = int(st.num_unique.item())
        hits, misses = st.lookup["counts"].cpu().tolist()
        pos = st.lookup["position"]
        entry_hit = pos[st.slots.long()] >= 0
        row.update(
            check_ok=ok1 and ok2 and hits + misses == u,
            worst_vs_f64=ratio1,
            worst_vs_uncached=ratio2,
            bitwise_vs_uncached=bool(torch.equal(common.bits(out_c), common.bits(out_u))),
            unique=u,
            unique_hits=hits,
            unique_misses=misses,
            unique_hit_rate=hits / max(u, 1),
            lookup_hit_rate=float(entry_hit.double().mean()),
            oracle_lookup_hit_rate=float(torch.isin(sets[0], perm[:C].to(dev)).double().mean()),
        )
        del ref, ref_abs, st_u, entry_hit
        # Whole forwards.
        fwd_u = lambda i: gh.tt_embedding_bag_forward(  # noqa: E731
            cores, p, q, ranks, sets[i % 3], off, table_splits=splits, check=False
        )
        fwd_c = lambda i: ghc.tt_embedding_bag_forward_cached(  # noqa: E731
            cores,
            p,
            q,
            ranks,
            sets[i % 3],
            off,
            cache_ids,
            cache_rows,
            table_splits=splits,
            check=False,
        )
        common.timed(row, "fwd_nocache", fwd_u, it)
        common.timed(row, "fwd_cache", fwd_c, it)
        # Pieces of the cached forward, each alone on the intermediates of its input set.
        states = [
            ghc.tt_embedding_bag_forward_cached(
                cores, p, q, ranks, s, off, cache_ids, cache_rows, table_splits=splits, check=False
            )[1]
            for s in sets
        ]
        sts_u = [
            gh.tt_embedding_bag_forward(
                cores, p, q, ranks, s, off, table_splits=splits, check=False
            )[1]
            for s in sets
        ]
        n_emb = N
        common.timed(
            row,
            "part_unique_ids",
            lambda i: gh.tt_unique_ids_async(
                sets[i % 3], splits, n_emb, N, None, unique_fill=ghc.EMPTY_CACHE_ID
            ),
            it,
        )
        common.timed(
            row, "part_lookup", lambda i: ghc.tt_cache_lookup(states[i % 3].unique, cache_ids), it
        )
        common.timed(
            row,
            "part_rows_misses",
            lambda i: gh.tt_rows_async(
                shape, cores, states[i % 3].lookup["miss_ids"], states[i % 3].num_miss
            ),
            it,
        )
        common.timed(
            row,
            "part_rows_all_unique",
            lambda i: gh.tt_rows_async(shape, cores, sts_u[i % 3].unique, sts_u[i % 3].num_unique),
            it,
        )
        common.timed(
            row,
            "part_stitch",
            lambda i: ghc.tt_select_rows(
                cache_rows,
                states[i % 3].lookup["position"],
                states[i % 3].miss_rows,
                states[i % 3].lookup["miss_rank"],
            ),
            it,
        )
        common.timed(
            row,
            "part_bag_reduce",
            lambda i: gh.forward_async(
                states[i % 3].rows, states[i % 3].slots, off, None, "sum", padding_id=-1
            ),
            it,
        )
        # Distinct level-1 prefixes (id // p_2: the products of level 1) among all unique ids
        # and among the misses: the TT work the misses still need at that level.
        row["level1_prefixes_unique"] = int(
            torch.unique(sts_u[0].unique[: int(sts_u[0].num_unique.item())] // p[2]).numel()
        )
        nm0 = int(states[0].num_miss.item())
        row["level1_prefixes_misses"] = int(
            torch.unique(states[0].lookup["miss_ids"][:nm0] // p[2]).numel()
        )
        # The same forwards with U and the misses known on the host (as the TF glue has them
        # after its one read-back): buffers and the stitch sized exactly, not by nnz.
        sizes = []
        for k in range(3):
            sizes.append((int(sts_u[k].num_unique.item()), int(states[k].num_miss.item())))

        def fwd_u_exact(i):
            u_, _ = sizes[i % 3]
            uq, sl, _ = gh.tt_unique_ids_async(sets[i % 3], splits, N, N, None)
            rows, _ = gh.tt_rows_async(shape, cores, uq[:u_])
            gh.forward_async(rows, sl, off, None, "sum", padding_id=-1)

        def fwd_c_exact(i):
            u_, m_ = sizes[i % 3]
            uq, sl, _ = gh.tt_unique_ids_async(sets[i % 3], splits, N, N, None)
            lk = ghc.tt_cache_lookup(uq[:u_], cache_ids)
            mr, _ = gh.tt_rows_async(shape, cores, lk["miss_ids"][:m_])
            rows = ghc.tt_select_rows(cache_rows, lk["position"], mr, lk["miss_rank"])
            gh.forward_async(rows, sl, off, None, "sum", padding_id=-1)

        common.timed(row, "fwd_nocache_exact", fwd_u_exact, it)
        common.timed(row, "fwd_cache_exact", fwd_c_exact, it)
        common.timed(
            row,
            "part_stitch_exact",
            lambda i: ghc.tt_select_rows(
                cache_rows,
                states[i % 3].lookup["position"][: sizes[i % 3][0]],
                states[i % 3].miss_rows,
                states[i % 3].lookup["miss_rank"][: sizes[i % 3][0]],
            ),
            it,
        )
        if row.get("fwd_nocache_exact_ms") and row.get("fwd_cache_exact_ms"):
            row["speedup_cache_exact"] = row["fwd_nocache_exact_ms"] / row["fwd_cache_exact_ms"]
        # Counting one batch (training's job, not the forward's), on copies of the table.
        k2, c2 = keys.clone(), counts.clone()
        common.timed(
            row, "count_per_batch", lambda i: ghc.tt_cache_count(sets[i % 3], k2, c2, N), it
        )
        states = sts_u = k2 = c2 = None
        if row.get("fwd_nocache_ms") and row.get("fwd_cache_ms"):
            row["speedup_cache"] = row["fwd_nocache_ms"] / row["fwd_cache_ms"]
            row["target_3x_met"] = row["speedup_cache"] >= 3.0
        res["cases"].append(row)
        common.log(json.dumps(row))
        sets = None
        torch.cuda.empty_cache()
    return res


def tt_cache_main(args, report):
    sweep, n_fail = common.run_poisoned(
        report, "tt_cache_", lambda: tt_cache_sweep(args.small, args.max_cases)
    )
    n_bits = sum(bool(r.get("bitwise_vs_uncached")) for r in sweep)
    common.log(
        f"tt_cache sweep: {len(sweep) - n_fail}/{len(sweep)} cases passed "
        f"({report['tt_cache_sweep_s']:.1f} s); output bitwise equal to the uncached forward "
        f"in {n_bits}/{len(sweep)}; hits/unique "
        + ", ".join(f"{r.get('hits')}/{r.get('unique')}" for r in sweep[:12])
    )
    common.log_worst(sweep, "tt_cache ", 22)
    passed = n_fail == 0
    if not args.small and not args.no_bench:
        try:
            bench = tt_cache_bench()
        except Exception as exc:  # noqa: BLE001
            bench = {"error": repr(exc)[:500], "trace": traceback.format_exc()}
            common.log(bench["trace"])
        report["tt_cache_bench"] = bench
        cases = bench.get("cases", [])
        passed = passed and "error" not in bench and all(c["check_ok"] for c in cases)
        for c in cases:
            common.log(
                f"tt_cache B={c['B']}: unique {c['unique']}, unique hit rate "
                f"{c['unique_hit_rate']:.3f}, lookup hit rate {c['lookup_hit_rate']:.3f} "
                f"(oracle {c['oracle_lookup_hit_rate']:.3f}); fwd no cache "
                f"{common.fmt(c.get('fwd_nocache_ms'), '.4f')} ms, with cache "
                f"{common.fmt(c.get('fwd_cache_ms'), '.4f')} ms: "
                f"{common.fmt(c.get('speedup_cache'), '.2f')}x "
                f"(target 3x); exact sizes {common.fmt(c.get('fwd_nocache_exact_ms'), '.4f')} / "
                f"{common.fmt(c.get('fwd_cache_exact_ms'), '.4f')} ms: "
                f"{common.fmt(c.get('speedup_cache_exact'), '.2f')}x; level-1 prefixes "
                f"{c.get('level1_prefixes_unique')} / misses {c.get('level1_prefixes_misses')}; "
                f"count/batch {common.fmt(c.get('count_per_batch_ms'), '.4f')} ms; parts "
                + ", ".join(
                    f"{k[5:-3]} {c[k]:.4f}"
                    for k in sorted(c)
                    if k.startswith("part_")
                    and k.endswith("_ms")
                    and not k.endswith(("_eager_ms", "_graph_ms"))
                    and c[k] is not None
                )
            )
    return passed


# ---------------------------------------------------------------------------
# Section "tt_zipf" (python3 python/gpu_harness/gpu_check.py --only tt_zipf): issue 5's Zipf target
# (Zipf(1.1) ids >= 2x faster than uniform) along the TF GPU ops' path, where U and n_k are
# known on the host (cc/kernels/tt_embedding_kernels_gpu.cc reads them back, one stream sync
# each), next to the harness's device-count path, in the same run. JSON to
# $OUT/gpu_check_tt_zipf.json.
#
# Paths (FBTT shape, f32, bag 20, sum; ids and dy from tt_bench_shape's generators):
#   dev:   tt_embedding_bag_forward(check=False) [+ backward_from(dense=True)]: U stays on the
#          device, buffers sized by nnz (the "tt" bench's path); graph replay medians.
#   host:  the TF glue's launcher sequence: TTUniqueIds -> copy of the report into pinned
#          memory + stream sync (U) -> TTRows of unique[:U] (exact) -> bag forward; backward:
#          bag backward into [U, D] -> TTRowsGrad prepare -> pinned copy + sync (n_k) ->
#          TTRowsGrad compute into [n_k] / [n_k, width_k]. Host syncs inside: plain CUDA
#          events around each whole call (eager medians), read-backs included.
#   exact: the host path's launches with U and n_k given (no read-back): its device work
#          alone, graph replay medians.
#   tfsync: the host path plus the other report read-backs the TF glue makes for its error
#          checks (after TTRows and the bag forward; after the bag backward, whose TF form is
#          the sparse gradient sized by a read-back); eager medians.


def tt_zipf_case(bags, length, dist, iters, p=(200, 220, 250), q=(4, 4, 4), ranks=(32, 32)):
    p, q, ranks = list(p), list(q), list(ranks)
    # tt_bench_shape's inputs: the same cores, ids and dy.
    cores, sets, off, splits = tt_bench_inputs(bags, length, dist, p, q, ranks)
    N = math.prod(p)
    shape = gh.TTShape(p, q, ranks)
    pinned = torch.empty(gh.TT_REPORT_WORDS, dtype=torch.int64, pin_memory=True)
    pinned2 = torch.empty(gh.TT_REPORT_WORDS, dtype=torch.int64, pin_memory=True)
    pinned_bag = torch.empty(gh.REPORT_WORDS, dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.current_stream()
    res = dict(section="tt_zipf", **tt_bench_fields(bags, length, dist, p, q, ranks), iters=iters)

    def readback(report, host):
        host.copy_(report, non_blocking=True)
        stream.synchronize()
        return host

    def host_fwd(i, syncs=False, U=None):
        ids, _ = sets[i % 3]
        unique, slots, urep = gh.tt_unique_ids_async(ids, splits, N, N)
        if U is None:
            U = int(readback(urep, pinned)[2])
        uq = unique[:U]
        rows, rrep = gh.tt_rows_async(shape, cores, uq)
        if syncs:
            readback(rrep, pinned)
        out, _, _, brep = gh.forward_async(rows, slots, off, None, "sum", padding_id=-1)
        if syncs:
            readback(brep, pinned_bag)
        return out, uq, rows, slots

    def host_fwd_bwd(i, syncs=False, U=None, counts=None):
        _, dy = sets[i % 3]
        out, uq, rows, slots = host_fwd(i, syncs, U)
        drows, _, _, grep = gh.backward_async(
            rows, slots, off, None, dy, "sum", padding_id=-1, dense=True
        )
        if syncs:
            readback(grep, pinned_bag)
        grads, _ = gh.tt_rows_grad(
            shape,
            cores,
            uq,
            drows,
            dense=False,
            counts=counts,
            host_report=None if counts is not None else pinned2,
        )
        return out, grads, uq.numel()

    def dev_fwd(i):
        ids, _ = sets[i % 3]
        return gh.tt_embedding_bag_forward(
            cores, p, q, ranks, ids, off, table_splits=splits, check=False
        )

    def dev_fwd_bwd(i):
        _, dy = sets[i % 3]
        out, st = dev_fwd(i)
        return out, gh.tt_embedding_bag_backward_from(st, dy, dense=True, check=False)[0]

    # Correctness first: the host path against the device-count path on every input set
    # (output bitwise or within 1e-6 of its scale; sparse core gradients against the dense
    # ones at their rows, zero elsewhere), and the sizes the exact path will be given.
    sizes = []
    checks = []
    ok = True
    try:
        for i in range(3):
            out_d, st = gh.tt_embedding_bag_forward(
                cores, p, q, ranks, sets[i][0], off, table_splits=splits, check=True
            )
            gd, _ = gh.tt_embedding_bag_backward_from(st, sets[i][1], dense=True, check=True)
            u_dev = int(st.num_unique.item())
            out_h, gs, U = host_fwd_bwd(i)
            out_s, gs2, _ = host_fwd_bwd(i, syncs=True)
            counts = [int(g[0].numel()) for g in gs]
            sizes.append((U, counts))
            out_e, ge, _ = host_fwd_bwd(i, U=U, counts=counts)
            torch.cuda.synchronize()
            scale = max(float(out_d.abs().max()), 1e-30)
            c = {
                "set": i,
                "unique": U,
                "unique_dev": u_dev,
                "core_rows": counts,
                "out_bitwise": bool(torch.equal(out_h, out_d)),
                "out_max_rel": float((out_h - out_d).abs().max()) / scale,
                "exact_bitwise_vs_host": bool(torch.equal(out_e, out_h))
                and bool(torch.equal(out_s, out_h))
                and all(
                    torch.equal(a[0], b[0])
                    and torch.equal(a[0], e[0])
                    and torch.equal(a[1], b[1])
                    and torch.equal(a[1], e[1])
                    for a, b, e in zip(gs, gs2, ge)
                ),
            }
            grad_bitwise, grad_rel, rows_ok = True, 0.0, True
            for k, (idx, vals) in enumerate(gs):
                dk = gd[k]
                if idx.numel() and not bool((idx[1:] > idx[:-1]).all()):
                    rows_ok = False
                sel = dk[idx]
                grad_bitwise = grad_bitwise and bool(torch.equal(sel, vals))
                gscale = max(float(dk.abs().max()), 1e-30)
                grad_rel = max(
                    grad_rel, float((sel - vals).abs().max()) / gscale if idx.numel() else 0.0
                )
                rest = dk.clone()
                rest[idx] = 0
                rows_ok = rows_ok and bool((rest == 0).all())
            c.update(grad_bitwise=grad_bitwise, grad_max_rel=grad_rel, grad_rows_ok=rows_ok)
            c["ok"] = (
                U == u_dev
                and (c["out_bitwise"] or c["out_max_rel"] <= 1e-6)
                and (grad_bitwise or grad_rel <= 1e-6)
                and rows_ok
                and c["exact_bitwise_vs_host"]
            )
            ok = ok and c["ok"]
            checks.append(c)
            del out_d, st, gd, out_h, gs, out_s, gs2, out_e, ge
    except Exception as exc:  # noqa: BLE001
        ok = False
        res["check_error"] = repr(exc)[:300]
        res["check_trace"] = traceback.format_exc()
        common.log(res["check_trace"])
    res["checks"] = checks
    res["check_ok"] = ok
    res["unique_ids"] = sizes[0][0] if sizes else None
    res["core_rows"] = sizes[0][1] if sizes else None
    torch.cuda.empty_cache()

    common.timed(res, "dev_fwd", dev_fwd, iters)
    common.timed(res, "dev_fwd_bwd", dev_fwd_bwd, iters)
    common.timed(res, "host_fwd", host_fwd, iters, graph=False)
    common.timed(res, "host_fwd_bwd", host_fwd_bwd, iters, graph=False)
    common.timed(res, "tfsync_fwd", lambda i: host_fwd(i, syncs=True), iters, graph=False)
    common.timed(res, "tfsync_fwd_bwd", lambda i: host_fwd_bwd(i, syncs=True), iters, graph=False)
    common.timed(res, "exact_fwd", lambda i: host_fwd(i, U=sizes[i % 3][0]), iters)
    common.timed(
        res,
        "exact_fwd_bwd",
        lambda i: host_fwd_bwd(i, U=sizes[i % 3][0], counts=sizes[i % 3][1]),
        iters,
    )
    sets = None
    torch.cuda.empty_cache()
    return res


TT_ZIPF_PATHS = ["dev", "host", "tfsync", "exact"]


def tt_zipf_main(args, report):
    cases = []
    for bags, iters in ((65536, 20), (512, 50)):
        for dist in ("uniform", "zipf"):
            t0 = time.time()
            try:
                r = tt_zipf_case(bags, 20, dist, iters)
            except Exception as exc:  # noqa: BLE001
                r = {
                    "section": "tt_zipf",
                    "bags": bags,
                    "dist": dist,
                    "check_ok": False,
                    "error": repr(exc)[:300],
                    "trace": traceback.format_exc(),
                }
                common.log(r["trace"])
            r["case_s"] = time.time() - t0
            common.log(json.dumps(r))
            cases.append(r)
    report["tt_zipf"] = cases
    by = {(c["bags"], c["dist"]): c for c in cases}
    targets = {}
    common.log(
        "tt_zipf (FBTT shape, f32, bag 20, sum; ms; dev/exact: graph replay medians, "
        "host/tfsync: eager CUDA-event medians with the host read-backs inside)"
    )
    common.log(
        f"{'B':>6s} {'path':7s} {'uni fwd':>8s} {'zipf fwd':>8s} {'x':>5s} "
        f"{'uni f+b':>8s} {'zipf f+b':>8s} {'x':>5s}  (eager uni/zipf fwd, f+b)"
    )
    for bags in (65536, 512):
        u, z = by.get((bags, "uniform"), {}), by.get((bags, "zipf"), {})
        for path in TT_ZIPF_PATHS:
            cells = []
            for k in ("fwd", "fwd_bwd"):
                a, b = u.get(f"{path}_{k}_ms"), z.get(f"{path}_{k}_ms")
                x = a / b if a and b else None
                targets[f"B={bags} {path} {k} zipf speedup (>=2)"] = x
                cells += [common.fmt(a, ".4f"), common.fmt(b, ".4f"), common.fmt(x, ".2f")]
            eager = " ".join(
                common.fmt(c.get(f"{path}_{k}_eager_ms"), ".4f")
                for k in ("fwd", "fwd_bwd")
                for c in (u, z)
            )
            common.log(
                f"{bags:6d} {path:7s} {cells[0]:>8s} {cells[1]:>8s} {cells[2]:>5s} "
                f"{cells[3]:>8s} {cells[4]:>8s} {cells[5]:>5s}  ({eager})"
            )
        common.log(
            f"       unique ids: uniform {u.get('unique_ids')}, zipf {z.get('unique_ids')}; "
            f"core rows n_k: {u.get('core_rows')} / {z.get('core_rows')}; checks "
            f"{u.get('check_ok')} / {z.get('check_ok')}"
        )
    report["tt_zipf_targets"] = targets
    common.log(json.dumps({"tt_zipf_targets": targets}))
    for c in cases:
        for ch in c.get("checks", []):
            common.log(
                f"  check B={c['bags']} {c['dist']} set {ch['set']}: U {ch['unique']} "
                f"(device {ch['unique_dev']}), out bitwise {ch['out_bitwise']} "
                f"(rel {ch['out_max_rel']:.2g}), grads bitwise {ch['grad_bitwise']} (rel "
                f"{ch['grad_max_rel']:.2g}), other rows zero {ch['grad_rows_ok']}, exact/tfsync "
                f"bitwise vs host {ch['exact_bitwise_vs_host']}"
            )
    return all(c.get("check_ok") for c in cases)
