"""gpu_check.py section "grs": gather_reduce_sum's CUDA kernels (forward, argmax, params and
weights gradients) against float64 references, error messages, determinism and benchmarks
against torch.nn.functional.embedding_bag."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_common as common  # noqa: E402
import harness as gh  # noqa: E402


def make_case(config, dtype, itype, combiner, weighted, seed, device=None):
    device = device or common.DEVICE
    name, n_rows, dim, (lo, hi), bags, dist, pad = config
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (bags,), generator=gen)
    offsets = torch.zeros(bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    nnz = int(offsets[-1])
    ids = common.make_ids(nnz, n_rows, dist, itype, gen, "cpu")
    if pad is not None and nnz:
        mask = torch.rand(nnz, generator=gen) < 0.15
        ids[mask] = pad
    params = torch.randn(n_rows, dim, generator=gen, dtype=torch.float64)
    if combiner == "max" and n_rows > 4:
        # Ties: some rows repeat others exactly, so the first-entry rule is exercised.
        params[1::4] = params[0::4][: params[1::4].shape[0]]
    weights = common.random_weights(nnz, combiner, gen) if weighted else None
    if weighted and name == "zero-den" and nnz >= 4:
        weights[0], weights[1] = 0.5, -0.5  # bag 0: sum of weights is 0
        weights[2], weights[3] = 0.0, 0.0  # bag 1: all weights 0
    grad = torch.randn(bags, dim, generator=gen, dtype=torch.float64)
    to = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return dict(
        params=to(params),
        ids=ids.to(device),
        offsets=offsets.to(device),
        weights=to(weights),
        grad=to(grad),
        padding_id=pad,
        combiner=combiner,
    )


# ---------------------------------------------------------------------------
# float64 references (CPU).


def reference(case, out_kernel=None):
    params = case["params"].cpu().double()
    ids = case["ids"].cpu().long()
    offsets = case["offsets"].cpu()
    w_in = case["weights"]
    combiner, pad = case["combiner"], case["padding_id"]
    grad = case["grad"].cpu().double()
    n_rows, dim = params.shape
    bags = offsets.numel() - 1
    nnz = ids.numel()
    lengths = offsets.diff()
    bag = torch.repeat_interleave(torch.arange(bags), lengths)
    pos_in_bag = torch.arange(nnz) - offsets[:-1][bag] if nnz else torch.zeros(0, dtype=torch.long)
    valid = ids != pad if pad is not None else torch.ones(nnz, dtype=torch.bool)
    vidx = valid.nonzero().squeeze(1)
    vid, vb, vpos = ids[vidx], bag[vidx], pos_in_bag[vidx]
    e = params[vid]
    m = vidx.numel()
    w = w_in.cpu().double()[vidx] if w_in is not None else torch.ones(m, dtype=torch.float64)
    ref = {}
    idx2 = vb[:, None].expand(-1, dim)
    count = torch.zeros(bags, dtype=torch.float64).index_add_(
        0, vb, torch.ones(m, dtype=torch.float64)
    )
    if combiner == "max":
        out = torch.full((bags, dim), -math.inf, dtype=torch.float64)
        out.scatter_reduce_(0, idx2, e, "amax", include_self=True)
        out[count == 0] = 0
        cand = torch.where(e == out[vb], vpos[:, None].double(), math.inf)
        am = torch.full((bags, dim), math.inf, dtype=torch.float64)
        am.scatter_reduce_(0, idx2, cand, "amin", include_self=True)
        am[count == 0] = -1
        ref["out"], ref["out_abs"], ref["argmax"] = out, out.abs(), am.long()
        contrib = torch.where(am[vb] == vpos[:, None].double(), grad[vb], 0.0)
        contrib_abs = contrib.abs()
    else:
        wsum = torch.zeros(bags, dtype=torch.float64).index_add_(0, vb, w)
        wsq = torch.zeros(bags, dtype=torch.float64).index_add_(0, vb, w * w)
        if combiner == "mean":
            scale = torch.where(wsum != 0, 1.0 / torch.where(wsum != 0, wsum, 1.0), 0.0)
        elif combiner == "sqrtn":
            scale = torch.where(wsq > 0, 1.0 / torch.sqrt(torch.where(wsq > 0, wsq, 1.0)), 0.0)
        else:
            scale = torch.ones(bags, dtype=torch.float64)
        out = torch.zeros(bags, dim, dtype=torch.float64).index_add_(0, vb, w[:, None] * e)
        out_abs = torch.zeros(bags, dim, dtype=torch.float64).index_add_(
            0, vb, w.abs()[:, None] * e.abs()
        )
        ref["out"], ref["out_abs"] = out * scale[:, None], out_abs * scale.abs()[:, None]
        coef = scale[vb] * w
        contrib = coef[:, None] * grad[vb]
        contrib_abs = coef.abs()[:, None] * grad[vb].abs()
        if w_in is not None:
            o = out_kernel.cpu().double() if out_kernel is not None else ref["out"]
            dot = (e * grad[vb]).sum(1)
            dot_abs = (e.abs() * grad[vb].abs()).sum(1)
            dyout = (grad * o).sum(1)
            dyout_abs = (grad.abs() * o.abs()).sum(1)
            s = scale[vb]
            if combiner == "mean":
                g = (dot - dyout[vb]) * s
                g_abs = (dot_abs + dyout_abs[vb]) * s.abs()
            elif combiner == "sqrtn":
                g = dot * s - w * dyout[vb] * s * s
                g_abs = dot_abs * s.abs() + w.abs() * dyout_abs[vb] * s * s
            else:
                g, g_abs = dot, dot_abs
            dw = torch.zeros(nnz, dtype=torch.float64)
            dw_abs = torch.zeros(nnz, dtype=torch.float64)
            dw[vidx], dw_abs[vidx] = g, g_abs
            ref["dw"], ref["dw_abs"] = dw, dw_abs
    dense = torch.zeros(n_rows, dim, dtype=torch.float64).index_add_(0, vid, contrib)
    dense_abs = torch.zeros(n_rows, dim, dtype=torch.float64).index_add_(0, vid, contrib_abs)
    ref["dense"], ref["dense_abs"] = dense, dense_abs
    ref["unique"] = torch.unique(vid)
    return ref


def check_case(config, dtype, itype, combiner, weighted, seed):
    case = make_case(config, dtype, itype, combiner, weighted, seed)
    res = dict(common.case_fields(config, dtype, itype, combiner, weighted), failures=[], worst={})
    fail = res["failures"]
    p, ids, off, w, dy, pad = (
        case[k] for k in ("params", "ids", "offsets", "weights", "grad", "padding_id")
    )
    out, argmax = gh.gather_reduce_sum_with_argmax(p, ids, off, w, combiner, pad)
    ref = reference(case, out_kernel=out)
    ok, ratio = common.close(out, ref["out"], ref["out_abs"], dtype)
    res["worst"]["forward"] = ratio
    if combiner == "max":
        exact = torch.equal(out.cpu().double(), ref["out"])
        if not (ok and exact):
            fail.append("forward max value")
        if not torch.equal(argmax.cpu().long(), ref["argmax"]):
            fail.append("forward argmax")
    elif not ok:
        fail.append(f"forward (worst error / sum|terms| = {ratio:.3g})")

    for dense in (True, False):
        pg, dw = gh.gather_reduce_sum_backward(p, ids, off, w, dy, combiner, pad, dense=dense)
        tag = "dense" if dense else "dedup"
        if dense:
            ok, ratio = common.close(pg, ref["dense"], ref["dense_abs"], dtype)
        else:
            uid, vals = pg
            if not torch.equal(uid.cpu().long(), ref["unique"]) or uid.dtype != ids.dtype:
                fail.append("dedup unique ids")
                ok, ratio = False, float("inf")
            else:
                u = ref["unique"]
                ok, ratio = common.close(vals, ref["dense"][u], ref["dense_abs"][u], dtype)
        res["worst"][f"params_grad_{tag}"] = ratio
        if not ok:
            fail.append(f"params grad {tag} ({ratio:.3g})")
        if w is not None:
            common.check_close(
                res,
                f"weights_grad_fused_{tag}",
                f"fused weights grad {tag}",
                dw,
                ref["dw"],
                ref["dw_abs"],
                dtype,
            )
    if w is not None:
        dw = gh.weights_grad(p, ids, off, w, dy, out, combiner, pad)
        common.check_close(res, "weights_grad", "weights grad", dw, ref["dw"], ref["dw_abs"], dtype)
    return res


def sweep_cases(small):
    configs = [c for c in common.CONFIGS if not small or c[0] in common.SMALL_CONFIGS]
    dtypes = [torch.bfloat16, torch.float32, torch.float64] if small else common.DTYPES
    cases = []
    for config in configs:
        for dtype in dtypes:
            for combiner in common.COMBINERS:
                for weighted in (False, True) if combiner != "max" else (False,):
                    for itype in common.INDEX_DTYPES:
                        cases.append((config, dtype, itype, combiner, weighted))
    if small:  # one id dtype per case, alternating
        cases = [c for i, c in enumerate(cases) if (i + i // 2) % 2 == 0]
    return cases


def run_sweep(small, max_cases=None):
    return common.run_cases(
        sweep_cases(small), check_case, 1, lambda c: common.case_fields(*c), "FAIL", max_cases
    )


def check_determinism(small):
    """Same inputs, several runs: every output must be bitwise identical."""
    out = []
    shapes = [(20000, 256, 2048, 64)] if not small else [(500, 64, 64, 32)]
    for dtype in (torch.float32, torch.bfloat16):
        for n_rows, dim, bags, length in shapes:
            config = ("det", n_rows, dim, (length, length), bags, "zipf", None)
            case = make_case(config, dtype, torch.int64, "sqrtn", True, 1234)
            p, ids, off, w, dy = (case[k] for k in ("params", "ids", "offsets", "weights", "grad"))
            runs = []
            for _ in range(3):
                fwd = gh.gather_reduce_sum(p, ids, off, w, "sqrtn")
                dense, dw = gh.gather_reduce_sum_backward(p, ids, off, w, dy, "sqrtn")
                (uid, vals), dw2 = gh.gather_reduce_sum_backward(
                    p, ids, off, w, dy, "sqrtn", dense=False
                )
                dws = gh.weights_grad(p, ids, off, w, dy, fwd, "sqrtn")
                runs.append(
                    [
                        common.bits(fwd),
                        common.bits(dense),
                        common.bits(dw),
                        uid,
                        common.bits(vals),
                        common.bits(dw2),
                        common.bits(dws),
                    ]
                )
            same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
            hot = int(torch.bincount(ids.long()).max())
            out.append(
                {
                    "dtype": common.SHORT[dtype],
                    "shape": [n_rows, dim, bags, length],
                    "hottest_row_entries": hot,
                    "bitwise_identical": same,
                }
            )
            common.log(
                f"determinism {common.SHORT[dtype]} N={n_rows} D={dim} B={bags}x{length} "
                f"hottest row {hot} entries: {'identical' if same else 'DIFFERENT'}"
            )
    return out


def check_errors():
    """Bad ids and offsets: the TF op's messages, from forward, params grad and weights grad."""
    results = []
    dev = "cuda"
    params = torch.randn(10, 8, device=dev)
    off = torch.tensor([0, 4, 10], device=dev)
    w = torch.rand(10, device=dev)
    dy = torch.randn(2, 8, device=dev)
    for itype in common.INDEX_DTYPES:
        big = 2**40 if itype == torch.int64 else 2**30
        ids = torch.tensor([1, 2, 3, 4, 5, 10, 6, -3, 7, big], dtype=itype, device=dev)
        ids_pad = torch.tensor([1, -1, 3, -3, 5, 9, 6, 10, 7, 1], dtype=itype, device=dev)
        cases = [
            (
                "forward",
                lambda: gh.gather_reduce_sum(params, ids, off),
                "indices[5] = 10 is not in [0, 10)",
            ),
            (
                "forward padding",
                lambda: gh.gather_reduce_sum(params, ids_pad, off, padding_id=-1),
                "indices[3] = -3 is not in [0, 10) and is not padding_id (-1)",
            ),
            (
                "forward max",
                lambda: gh.gather_reduce_sum(params, ids, off, combiner="max"),
                "indices[5] = 10 is not in [0, 10)",
            ),
            (
                "params grad dense",
                lambda: gh.gather_reduce_sum_backward(params, ids, off, w, dy),
                "indices[5] = 10 is not in [0, 10)",
            ),
            (
                "params grad dedup",
                lambda: gh.gather_reduce_sum_backward(params, ids, off, None, dy, dense=False),
                "indices[5] = 10 is not in [0, 10)",
            ),
            (
                "weights grad",
                lambda: gh.weights_grad(params, ids, off, w, dy),
                "indices[5] = 10 is not in [0, 10)",
            ),
            (
                "huge id",
                lambda: gh.gather_reduce_sum(
                    params, ids[9:], off * 0 + torch.tensor([0, 0, 1], device=dev)
                ),
                f"indices[0] = {big} is not in [0, 10)",
            ),
            (
                "row_splits[0]",
                lambda: gh.gather_reduce_sum(params, ids[:3], torch.tensor([1, 2, 3], device=dev)),
                "row_splits[0] = 1 must be 0",
            ),
            (
                "row_splits decreasing",
                lambda: gh.gather_reduce_sum(
                    params, ids[:5], torch.tensor([0, 3, 2, 5], device=dev)
                ),
                "row_splits must be non-decreasing: row_splits[2] = 2 < row_splits[1] = 3",
            ),
            (
                "row_splits last",
                lambda: gh.gather_reduce_sum(params, ids[:5], torch.tensor([0, 3, 4], device=dev)),
                "row_splits[2] = 4 must equal the number of indices (5)",
            ),
            (
                "row_splits decreasing grad",
                lambda: gh.gather_reduce_sum_backward(
                    params,
                    ids[:5],
                    torch.tensor([0, 3, 2, 5], device=dev),
                    None,
                    torch.randn(3, 8, device=dev),
                ),
                "row_splits must be non-decreasing: row_splits[2] = 2 < row_splits[1] = 3",
            ),
            (
                "max with weights",
                lambda: gh.gather_reduce_sum(params, ids, off, w, "max"),
                "combiner 'max' does not take weights",
            ),
        ]
        for name, fn, msg in cases:
            ok, got = common.expect_error(fn, msg)
            results.append(
                {"itype": common.SHORT[itype], "case": name, "ok": ok, "got": got, "want": msg}
            )
            if not ok:
                common.log(
                    f"FAIL error check {name} {common.SHORT[itype]}: got {got!r}, want {msg!r}"
                )
    torch.cuda.synchronize()
    return results


# ---------------------------------------------------------------------------
# Benchmarks.


def bench_shape(name, n_rows, dim, bags, length, dtype, weighted, iters, backward_form):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(7)
    nnz = bags * length
    params = torch.randn(n_rows, dim, device=dev, dtype=dtype, generator=gen)
    sets = []
    for _ in range(3):
        ids = torch.randint(0, n_rows, (nnz,), device=dev, generator=gen)
        w = torch.rand(nnz, device=dev, dtype=dtype, generator=gen) if weighted else None
        dy = torch.randn(bags, dim, device=dev, dtype=dtype, generator=gen)
        sets.append((ids, w, dy))
    off = torch.arange(0, nnz + 1, length, device=dev)
    gathered = nnz * dim * params.element_size()
    r = {
        "shape": name,
        "N": n_rows,
        "D": dim,
        "bags": bags,
        "bag_len": length,
        "dtype": common.SHORT[dtype],
        "weighted": weighted,
        "gathered_bytes": gathered,
    }
    dense = backward_form == "dense-fused"

    def ours_fwd(i):
        ids, w, _ = sets[i % 3]
        gh.forward_async(params, ids, off, w)

    def ours_fwd_checked(i):
        ids, w, _ = sets[i % 3]
        gh.gather_reduce_sum(params, ids, off, w)

    def ours_bwd(i):
        ids, w, dy = sets[i % 3]
        gh.backward_async(params, ids, off, w, dy, dense=dense)

    def ours_fwd_bwd(i):
        ours_fwd(i)
        ours_bwd(i)

    def ours_fwd_bwd_checked(i):
        ids, w, dy = sets[i % 3]
        _, _, c1, rep1 = gh.forward_async(params, ids, off, w)
        _, _, c2, rep2 = gh.backward_async(params, ids, off, w, dy, dense=dense)
        c1.raise_for(rep1)
        if dense:
            c2.raise_for(rep2)

    def torch_fwd(i):
        ids, w, _ = sets[i % 3]
        F.embedding_bag(ids, params, off[:-1], mode="sum", per_sample_weights=w)

    p_leaf = params.detach().clone().requires_grad_(True)
    leaves = [
        w.detach().clone().requires_grad_(True) if w is not None else None for _, w, _ in sets
    ]

    def torch_fwd_bwd(i):
        ids, _, dy = sets[i % 3]
        out = F.embedding_bag(ids, p_leaf, off[:-1], mode="sum", per_sample_weights=leaves[i % 3])
        inputs = [p_leaf] + ([leaves[i % 3]] if weighted else [])
        torch.autograd.grad(out, inputs, dy)

    common.timed(r, "ours_fwd", ours_fwd, iters)
    common.timed(r, "ours_fwd_checked", ours_fwd_checked, iters, graph=False)
    common.timed(r, "torch_fwd", torch_fwd, iters)
    # The deduplicated form reads U back to size its output: eager only.
    common.timed(r, "ours_bwd", ours_bwd, iters, graph=dense)
    common.timed(r, "ours_fwd_bwd", ours_fwd_bwd, iters, graph=dense)
    common.timed(r, "ours_fwd_bwd_checked", ours_fwd_bwd_checked, iters, graph=False)
    common.timed(r, "torch_fwd_bwd", torch_fwd_bwd, iters)
    if r.get("torch_fwd_bwd_ms") and r.get("torch_fwd_ms"):
        # torch's backward alone: its fwd+bwd less its forward, from the same timing mode.
        mode = (
            "graph" if r.get("torch_fwd_bwd_graph_ms") and r.get("torch_fwd_graph_ms") else "eager"
        )
        r["torch_bwd_ms"] = r[f"torch_fwd_bwd_{mode}_ms"] - r[f"torch_fwd_{mode}_ms"]
    r["ours_fwd_TBps"] = gathered / r["ours_fwd_ms"] / 1e9 if r.get("ours_fwd_ms") else None
    r["torch_fwd_TBps"] = gathered / r["torch_fwd_ms"] / 1e9 if r.get("torch_fwd_ms") else None
    r["ours_bwd_form"] = (
        "dense [N, D] + fused weights grad"
        if dense and weighted
        else "dense [N, D]"
        if dense
        else "deduplicated [U, D] (reads U back)"
    )
    for k in ("fwd", "bwd", "fwd_bwd"):
        t, o = r.get(f"torch_{k}_ms"), r.get(f"ours_{k}_ms")
        r[f"speedup_{k}"] = t / o if t and o else None
    p_leaf = leaves = None
    torch.cuda.empty_cache()
    return r


def run_benchmarks():
    rows = []
    specs = [
        ("PKM", 262144, 1024, 16384, 128, torch.float32, True, 20, "dense-fused"),
        ("PKM", 262144, 1024, 16384, 128, torch.bfloat16, True, 20, "dense-fused"),
        ("DLRM", 10_000_000, 64, 8192, 20, torch.float32, False, 50, "dedup"),
    ]
    for spec in specs:
        try:
            r = bench_shape(*spec)
        except Exception as exc:  # noqa: BLE001
            r = {
                "shape": spec[0],
                "dtype": common.SHORT[spec[5]],
                "error": repr(exc)[:300],
                "trace": traceback.format_exc(),
            }
        rows.append(r)
        common.log(json.dumps(r))
    return rows


def profile_run():
    """The PKM shapes once each (forward, then dense backward with the fused weights
    gradient), for a profiler such as ncu to catch the kernels."""
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device="cuda").manual_seed(3)
        params = torch.randn(262144, 1024, device="cuda", dtype=dtype, generator=gen)
        ids = torch.randint(0, 262144, (16384 * 128,), device="cuda", generator=gen)
        w = torch.rand(ids.numel(), device="cuda", dtype=dtype, generator=gen)
        dy = torch.randn(16384, 1024, device="cuda", dtype=dtype, generator=gen)
        off = torch.arange(0, ids.numel() + 1, 128, device="cuda")
        gh.forward_async(params, ids, off, w)
        gh.backward_async(params, ids, off, w, dy, dense=True)
        torch.cuda.synchronize()


def grs_main(args, report):
    """Section "grs": the sweep, error messages, determinism, then (unless --small or
    --no-bench) the benchmarks; logs the summary. Returns whether every check passed."""
    sweep, n_failed, summary = common.run_section(
        report, "", args, run_sweep, check_errors, check_determinism
    )
    if not args.small and not args.no_bench:
        report["copy_TBps"] = common.copy_bandwidth()
        report["bench"] = run_benchmarks()

    common.log("")
    common.log(summary)
    common.log_worst(sweep, "", 28)
    if "bench" in report:
        common.log(f"device-to-device copy: {report['copy_TBps']:.2f} TB/s (read + write)")
        common.log(
            f"{'shape':6s} {'dtype':5s} {'ours fwd':>9s} {'TB/s':>5s} {'torch fwd':>9s} "
            f"{'x':>5s} {'ours bwd':>9s} {'torch bwd':>9s} {'x':>5s} {'ours f+b':>9s} "
            f"{'torch f+b':>9s} {'x':>5s}  backward form"
        )
        for r in report["bench"]:
            if "error" in r:
                common.log(f"{r['shape']:6s} {r['dtype']:5s} error {r['error']}")
                continue
            common.log(
                f"{r['shape']:6s} {r['dtype']:5s} {common.fmt(r.get('ours_fwd_ms')):>9s} "
                f"{common.fmt(r.get('ours_fwd_TBps'), '.2f'):>5s} "
                f"{common.fmt(r.get('torch_fwd_ms')):>9s} "
                f"{common.fmt(r.get('speedup_fwd'), '.2f'):>5s} "
                f"{common.fmt(r.get('ours_bwd_ms')):>9s} "
                f"{common.fmt(r.get('torch_bwd_ms')):>9s} "
                f"{common.fmt(r.get('speedup_bwd'), '.2f'):>5s} "
                f"{common.fmt(r.get('ours_fwd_bwd_ms')):>9s} "
                f"{common.fmt(r.get('torch_fwd_bwd_ms')):>9s} "
                f"{common.fmt(r.get('speedup_fwd_bwd'), '.2f'):>5s}  {r['ours_bwd_form']}"
            )
        common.log(
            "(graph-replay medians where capturable, else eager; *_checked in the JSON add "
            "the read-back of the device report)"
        )
    return n_failed == 0
