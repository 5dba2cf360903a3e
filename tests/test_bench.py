"""`python -m tf_ttemb bench` (tf_ttemb/bench.py, tf_ttemb/_bench_cases.py,
tf_ttemb/_bench_torch.py): the presets and explicit options, a run of every case at small
odd sizes (JSON and table), the tt_bag case against numpy, and torch's child process
(its JSON protocol, its data, and one line when torch fails). Nothing here asserts on a
time, only that times exist and agree with each other.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from processes import run_cli, run_fresh_python

import tf_ttemb
from tf_ttemb import _bench_cases, _bench_torch, bench
from tf_ttemb.__main__ import build_parser

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
BUILD_INFO = json.loads((pathlib.Path(tf_ttemb.__file__).parent / "_build_info.json").read_text())
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _run(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    return run_cli("bench", *args, pythonpath=pythonpath)


def _parse(*argv: str):
    parser, commands = build_parser()
    bench.add_arguments(commands.choices["bench"])
    return parser.parse_args(["bench", *argv])


def _runs(*argv: str):
    args = _parse(*argv)
    return [bench.resolve(args, name) for name in (args.preset or [None])]


# ----------------------------------------------------------------------------------------
# Presets and options.


def test_no_preset_keeps_the_defaults():
    (opts,) = _runs()
    assert opts.preset is None
    assert opts.cases == list(bench.CASES)
    assert opts.dtypes == ["float32"] and opts.index_dtype == "int32"
    for name, (default, _, _) in bench.SIZES.items():
        assert getattr(opts, name) == default, name
    (quick,) = _runs("--quick")
    for name, (_, value, _) in bench.SIZES.items():
        assert getattr(quick, name) == value, name


@pytest.mark.parametrize(
    "preset,sizes,cases,dtypes",
    [
        (
            "dlrm",
            {"rows": 10_000_000, "dim": 64, "bags": 8192, "bag_size": 20},
            ["gather_reduce_sum"],
            ["float32"],
        ),
        (
            "pkm",
            {"rows": 262_144, "dim": 1024, "bags": 16_384, "bag_size": 128},
            ["gather_reduce_sum"],
            ["float32", "bfloat16"],
        ),
        (
            "fbtt",
            {
                "tt_rows": 11_000_000,
                "tt_dim": 64,
                "tt_p": [200, 220, 250],
                "tt_q": [4, 4, 4],
                "tt_rank": 32,
                "tt_bags": [512, 65_536],
                "tt_bag_size": 20,
            },
            ["tt_bag"],
            ["float32"],
        ),
    ],
)
def test_preset_sets_sizes_cases_and_dtypes(preset, sizes, cases, dtypes):
    (opts,) = _runs("--preset", preset)
    assert opts.preset == preset
    assert {name: getattr(opts, name) for name in sizes} == sizes
    assert opts.cases == cases and opts.dtypes == dtypes
    assert opts.index_dtype == "int64"
    # What the preset does not set keeps its default.
    for name, (default, _, _) in bench.SIZES.items():
        if name not in sizes:
            assert getattr(opts, name) == default, name


def test_explicit_options_win_over_the_preset():
    (opts,) = _runs(
        "--preset",
        "dlrm",
        "--rows",
        "5,000",
        "--bags",
        "7",
        "--dtypes",
        "float64",
        "--index-dtype",
        "int32",
        "--cases",
        "gather_reduce_sum,tt_rows",
        "--repeats",
        "4",
    )
    assert (opts.rows, opts.bags, opts.dim, opts.bag_size) == (5000, 7, 64, 20)
    assert opts.dtypes == ["float64"] and opts.index_dtype == "int32"
    assert opts.cases == ["gather_reduce_sum", "tt_rows"] and opts.repeats == 4
    (opts,) = _runs("--preset", "fbtt", "--tt-bags", "3,9", "--tt-rank", "4")
    assert opts.tt_bags == [3, 9] and opts.tt_rank == 4 and opts.tt_p == [200, 220, 250]


def test_quick_shrinks_a_preset_to_its_quick_sizes():
    (opts,) = _runs("--preset", "dlrm", "--quick")
    assert (opts.rows, opts.dim, opts.bags, opts.bag_size) == (100_000, 64, 1024, 20)
    assert (opts.repeats, opts.in_graph_steps, opts.warmup) == (3, 2, 1)
    (opts,) = _runs("--preset", "fbtt", "--quick")
    assert opts.tt_bags == [64, 512]
    assert (opts.tt_rows, opts.tt_p, opts.tt_q, opts.tt_rank) == (
        11_000_000,
        [200, 220, 250],
        [4, 4, 4],
        32,
    )
    (opts,) = _runs("--preset", "pkm", "--quick", "--bags", "9")
    assert (opts.rows, opts.dim, opts.bags) == (16_384, 1024, 9)


def test_several_presets_are_several_runs():
    runs = _runs("--preset", "dlrm,fbtt", "--rows", "77")
    assert [o.preset for o in runs] == ["dlrm", "fbtt"]
    assert [o.rows for o in runs] == [77, 77]  # explicit: every run
    assert runs[1].cases == ["tt_bag"] and runs[1].tt_rows == 11_000_000
    labels = [(i.label, i.dtype) for i in bench.plan(runs)]
    assert labels == [
        ("dlrm:gather_reduce_sum", "float32"),
        ("fbtt:tt_bag[512x20]", "float32"),
        ("fbtt:tt_bag[65536x20]", "float32"),
    ]
    seeds = [i.seed for i in bench.plan(runs)]
    assert len({tuple(s) for s in seeds}) == 3


def test_help_states_the_presets_and_their_sizes():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for words in (
        "--preset NAME[,NAME...]",
        "10,000,000 x 64 float32 table (2.4 GiB)",
        "262,144 x 1024 values table",
        "p = [200, 220, 250]",
        "sized for a GPU",
        "add --quick",
        "--tt-bags N[,N...]",
        "--torch {auto,child,off}",
    ):
        assert words in text, words


def test_bad_presets_and_sizes_are_refused():
    proc = _run("--preset", "dlrm,bert")
    assert proc.returncode == 2
    assert "unknown choice(s) 'bert'; choose from dlrm, pkm, fbtt" in proc.stderr
    proc = _run("--tt-bags", "5,0")
    assert proc.returncode == 2
    assert "expected an integer >= 1, got 0" in proc.stderr


# ----------------------------------------------------------------------------------------
# A run of every case.

TT_BAGS = (5, 3)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _run(
        "--quick",
        "--dtypes",
        "float32,float64",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--rows",
        "3001",
        "--dim",
        "7",
        "--bags",
        "33",
        "--bag-size",
        "5",
        "--tt-rows",
        "5003",
        "--tt-dim",
        "12",
        "--tt-rank",
        "3",
        "--tt-lookups",
        "257",
        "--tt-bags",
        ",".join(map(str, TT_BAGS)),
        "--tt-bag-size",
        "4",
        "--pkm-tokens",
        "37",
        "--pkm-dim",
        "24",
        "--pkm-keys",
        "16",
        "--pkm-knn",
        "4",
        "--threads",
        "2",
        "--json",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(path.read_text())


def test_bench_json(bench_run):
    _, result = bench_run
    rows = result["results"]
    dtypes = ("float32", "float64")
    tt_labels = [f"tt_bag[{b}x4]" for b in TT_BAGS]
    want = (
        [
            (c, c, d, i)
            for c in ("gather_reduce_sum", "tt_rows")
            for d in dtypes
            for i in ("custom_op", "tf_gather")
        ]
        + [
            ("tt_bag", t, d, i)
            for t in tt_labels
            for d in dtypes
            for i in ("custom_op", "composite")
        ]
        + [("pkm", "pkm", "float32", "custom_op"), ("pkm", "pkm", "float32", "composite")]
        # torch's embedding_bag joins the gather_reduce_sum case on the CPU where installed.
        + [("gather_reduce_sum", "gather_reduce_sum", d, "torch") for d in dtypes if HAVE_TORCH]
    )
    assert sorted((r["case"], r["label"], r["dtype"], r["impl"]) for r in rows) == sorted(want)
    tolerance = {"float32": 1e-4, "float64": 1e-10}
    for r in rows:
        assert r["errors"] == {}, r
        assert r["baseline"] is (r["impl"] in ("tf_gather", "composite")), r
        assert r["in_graph_steps"] == 2  # --quick
        for kind in ("fwd", "fwd_bwd"):
            timing = r[kind]
            assert timing["repeats"] == 2
            assert math.isfinite(timing["median_ms"]) and timing["median_ms"] > 0, r
            assert 0 < timing["min_ms"] <= timing["median_ms"], r
            # The implementations agree with the baseline (which is 0 against itself).
            assert 0 <= r["max_rel_diff"][kind] < tolerance[r["dtype"]], r
            if r["baseline"]:
                assert r["max_rel_diff"][kind] == 0.0
        # In graph (fwd, fwd+bwd) and chained (fwd): per step; none for torch.
        for kind in ("fwd_in_graph", "fwd_chained", "fwd_bwd_in_graph"):
            if r["impl"] == "torch":
                assert r[kind] is None
            else:
                loop = r[kind]
                assert math.isfinite(loop["median_ms"]) and 0 < loop["min_ms"] <= loop["median_ms"]
        if r["case"] == "tt_bag":  # also against numpy's float64 rows
            assert 0 <= r["max_rel_diff"]["fwd_reference"] < tolerance[r["dtype"]], r
    shapes = {r["label"]: r["shape"] for r in rows}
    assert shapes["gather_reduce_sum"] == "3,001x7 table, 33 bags x 5 int32 ids, weighted sum"
    assert shapes["tt_rows"].startswith("5,003x12 table as TT")
    assert shapes["tt_rows"].endswith("257 ids")
    assert shapes["tt_bag[5x4]"].startswith("5,003x12 table as TT")
    assert "5 bags x 4 ids, sum; fwd+bwd = one training step of" in shapes["tt_bag[5x4]"]
    assert shapes["pkm"] == "37 tokens x 24, 16**2 = 256 slots, 2 heads x 4 knn"
    env = result["environment"]
    assert env["tf_version"] == tf.__version__
    assert env["build"] == BUILD_INFO
    assert env["intra_op_threads"] == 2
    assert result["options"]["rows"] == 3001 and result["options"]["tt_dim"] == 12
    assert result["options"]["preset"] is None
    (run,) = result["runs"]
    assert run["rows"] == 3001 and run["tt_rank"] == 3 and run["tt_bags"] == list(TT_BAGS)
    assert run["index_dtype"] == "int32" and run["in_graph_steps"] == 2
    assert result["seconds"] > 0


def test_bench_per_lookup_and_gathered_bandwidth(bench_run):
    _, result = bench_run
    lookups = {"gather_reduce_sum": 33 * 5, "tt_rows": 257, "pkm": None}
    lookups.update({f"tt_bag[{b}x4]": b * 4 for b in TT_BAGS})
    for r in result["results"]:
        assert r["lookups"] == lookups[r["label"]], r
        if r["lookups"] is None:
            assert r["us_per_lookup"] is None and r["gathered_tb_s"] is None
            continue
        for kind, us in r["us_per_lookup"].items():
            assert us == pytest.approx(r[kind]["median_ms"] * 1e3 / r["lookups"])
        if r["case"] == "gather_reduce_sum" and r["impl"] != "torch":
            itemsize = {"float32": 4, "float64": 8}[r["dtype"]]
            assert r["gathered_bytes"] == 33 * 5 * 7 * itemsize
            seconds = r["fwd_in_graph"]["median_ms"] * 1e-3
            assert r["gathered_tb_s"] == pytest.approx(r["gathered_bytes"] / seconds / 1e12)
        else:
            assert r["gathered_tb_s"] is None


def test_bench_tables(bench_run):
    out, result = bench_run
    lines = out.splitlines()
    rows = result["results"]
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    table = lines[header : header + 2 + len(rows)]
    # Aligned: every line of the table has the header's width.
    assert len({len(line.rstrip()) for line in table}) == 1, table
    for r, line in zip(rows, table[2:]):
        cells = line.split()
        assert cells[:3] == [r["label"], r["dtype"], r["impl"]], line
        off = 1 if r["baseline"] else 0
        assert float(cells[3 + off]) == pytest.approx(r["fwd"]["median_ms"], abs=1e-3)
        loop = r["fwd_in_graph"]
        assert cells[5 + off] == ("n/a" if loop is None else f"{loop['median_ms']:.3f}"), line
        both = r["fwd_bwd_in_graph"]
        assert cells[9 + off] == ("n/a" if both is None else f"{both['median_ms']:.3f}"), line
    per_lookup = next(i for i, line in enumerate(lines) if line.startswith("Per lookup"))
    assert lines[per_lookup + 1].startswith("case ") and "gathered TB/s" in lines[per_lookup + 1]
    with_lookups = [r for r in rows if r["lookups"]]
    for r, line in zip(with_lookups, lines[per_lookup + 3 : per_lookup + 3 + len(with_lookups)]):
        cells = line.split()
        assert cells[:4] == [r["label"], r["dtype"], r["impl"], f"{r['lookups']:,}"], line
        assert float(cells[4]) == pytest.approx(r["us_per_lookup"]["fwd"], abs=1e-4)
    if not HAVE_TORCH:
        assert "torch: not installed, so not timed" in out


# ----------------------------------------------------------------------------------------
# tt_bag against numpy.


def _tt_rows(cores, p, q, ranks, ids):
    """Rows of a TT table by the definition (docs/tt_embedding_contract.md), in float64."""
    r = [1, *ranks, 1]
    blocks = [c.reshape(len(c), r[k], q[k], r[k + 1]) for k, c in enumerate(cores)]
    out = []
    for i in np.asarray(ids).reshape(-1):
        digits = np.unravel_index(int(i), p)
        g0, g1, g2 = (blocks[k][digits[k]] for k in range(3))
        out.append(np.einsum("aib,bjc,ckd->ijk", g0, g1, g2).reshape(-1))
    return np.array(out).reshape(*np.shape(ids), -1)


def _tt_bag_sum_grads(cores, p, q, ranks, ids, upstream):
    """d sum(upstream * bags) / d cores, bags the sums of the rows of `ids`, in float64."""
    r = [1, *ranks, 1]
    blocks = [c.reshape(len(c), r[k], q[k], r[k + 1]) for k, c in enumerate(cores)]
    grads = [np.zeros_like(b) for b in blocks]
    for bag, row_ids in enumerate(ids):
        u = upstream[bag].reshape(q)
        for i in row_ids:
            d = np.unravel_index(int(i), p)
            g0, g1, g2 = (blocks[k][d[k]] for k in range(3))
            # r_0 = r_3 = 1: the outer rank indices a and d are singletons.
            grads[0][d[0]] += np.einsum("ijk,bjc,ckd->ib", u, g1, g2)[None]
            grads[1][d[1]] += np.einsum("ijk,aib,ckd->bjc", u, g0, g2)
            grads[2][d[2]] += np.einsum("ijk,aib,bjc->ck", u, g0, g1)[..., None]
    return [g.reshape(c.shape) for g, c in zip(grads, cores)]


@pytest.mark.parametrize("dtype,tolerance", [("float64", 1e-10), ("float32", 1e-5)])
def test_tt_bag_case_against_numpy(dtype, tolerance):
    (opts,) = _runs(
        "--quick",
        "--tt-rows",
        "1003",
        "--tt-dim",
        "12",
        "--tt-p",
        "11,10,10",
        "--tt-q",
        "2,2,3",
        "--tt-rank",
        "3",
        "--tt-bag-size",
        "4",
    )
    opts.torch_mode = "off"
    case = _bench_cases.build_tt_bag(opts, dtype, [5, 6], "tt_bag[6x4]", bags=6)
    p, q, ranks = case.data["p"], case.data["q"], case.data["ranks"]
    assert (p, q, ranks) == ([11, 10, 10], [2, 2, 3], [3, 3])
    ids = case.inputs[0].numpy()
    assert ids.shape == (6, 4) and len(case.inputs) == 2
    upstream = case.data["upstream"].numpy().astype(np.float64)
    initial = case.data["initial_cores"]
    # Building the case ran one training step of each layer, from the same cores: each
    # took plain SGD (learning rate TT_LEARNING_RATE) on the gradient of sum(upstream *
    # bags).
    grads = _tt_bag_sum_grads(initial, p, q, ranks, ids, upstream)
    for impl in case.impls:
        layer = case.data["layers"][impl.name]
        for core, start, grad in zip(layer.cores, initial, grads):
            want = start - _bench_cases.TT_LEARNING_RATE * grad
            scale = np.abs(want).max()
            np.testing.assert_allclose(
                core.numpy().astype(np.float64), want, atol=tolerance * scale
            )
        # The forward, on the layer's cores as they are now.
        cores = [c.numpy().astype(np.float64) for c in layer.cores]
        want = _tt_rows(cores, p, q, ranks, ids).sum(axis=-2)
        got = tf.cast(impl.fwd(case.inputs[0]), tf.float64).numpy()
        np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max())
    # The bench's own checks say the same.
    for impl in ("custom_op", "composite"):
        assert set(case.diffs[impl]) == {"fwd", "fwd_bwd", "fwd_reference"}
        assert max(case.diffs[impl].values()) < tolerance, case.diffs


def _grs_case(monkeypatch, compare_bags, *argv):
    monkeypatch.setattr(_bench_cases, "COMPARE_BAGS", compare_bags)
    (opts,) = _runs(
        "--quick",
        "--cases",
        "gather_reduce_sum",
        "--rows",
        "50",
        "--dim",
        "7",
        "--bags",
        "12",
        "--bag-size",
        "5",
        "--in-graph-steps",
        "2",
        *argv,
    )
    opts.torch_mode = "off"
    return opts, _bench_cases.build_gather_reduce_sum(opts, "float64", [3, 4], "grs")


@pytest.mark.parametrize("compare_bags", [4, 2048])
@pytest.mark.parametrize("broken", [False, True])
def test_gather_reduce_sum_case_compares_its_first_bags(monkeypatch, compare_bags, broken):
    """The agreement is checked on the first COMPARE_BAGS bags of the first batch (all
    12 with 2048): a custom op that is right gives float64 rounding, one that is off by
    0.1% shows."""
    if broken:
        right = tf_ttemb.gather_reduce_sum
        monkeypatch.setattr(tf_ttemb, "gather_reduce_sum", lambda *a, **k: right(*a, **k) * 1.001)
    _, case = _grs_case(monkeypatch, compare_bags)
    assert max(case.diffs["tf_gather"].values()) == 0
    worst = max(case.diffs["custom_op"].values())
    assert worst > 5e-4 if broken else worst < 1e-12, case.diffs
    # torch's check holds the baseline's first CHECK_BAGS bags: output, weights gradient.
    count = min(_bench_torch.CHECK_BAGS, compare_bags)
    out, weights_grad = case.torch_check["fwd_bwd"]
    assert out.shape == (count, 7) and weights_grad.shape == (count, 5)
    np.testing.assert_allclose(case.torch_check["fwd"][0], out)


def test_baseline_per_call_only_leaves_the_baselines_in_graph_times_out(monkeypatch):
    opts, case = _grs_case(
        monkeypatch, 2048, "--baseline-per-call-only", "--repeats", "1", "--warmup", "1"
    )
    assert opts.baseline_per_call_only
    rows = {r["impl"]: r for r in _bench_cases.time_case(case, opts)}
    for kind in ("fwd", "fwd_bwd"):
        assert rows["tf_gather"][kind] is not None and rows["custom_op"][kind] is not None
    for kind in ("fwd_in_graph", "fwd_chained", "fwd_bwd_in_graph"):
        assert rows["tf_gather"][kind] is None and rows["tf_gather"]["errors"] == {}
        assert rows["custom_op"][kind] is not None
    (pkm,) = _runs("--preset", "pkm")
    (dlrm,) = _runs("--preset", "dlrm")
    assert pkm.baseline_per_call_only and not dlrm.baseline_per_call_only


# ----------------------------------------------------------------------------------------
# torch.


def test_bag_data_is_the_same_in_every_process_and_for_every_batch_count():
    one = _bench_torch.bag_data([3, 1, 2], 101, 6, 9, 4)
    many = _bench_torch.bag_data([3, 1, 2], 101, 6, 9, 4, batches=3)
    for key in ("table", "weights", "upstream"):
        np.testing.assert_array_equal(one[key], many[key])
    np.testing.assert_array_equal(one["ids"][0], many["ids"][0])
    assert len(many["ids"]) == 3 and not np.array_equal(many["ids"][0], many["ids"][1])
    assert one["table"].dtype == np.float32 and one["ids"][0].dtype == np.int64
    assert one["ids"][0].min() >= 0 and one["ids"][0].max() < 101
    assert (0.5 <= one["weights"]).all() and (one["weights"] < 1.5).all()


def test_torch_child_protocol_and_results():
    if not HAVE_TORCH:
        pytest.skip("torch is not installed (pip install torch): the child runs where it is")
    (opts,) = _runs("--quick", "--repeats", "2", "--warmup", "1", "--threads", "1")
    shapes = {"a": (50, 5, 11, 3, "float64"), "b": (40, 3, 6, 2, "float32")}
    cases = [
        {"key": key, "seed": [7, i], "rows": n, "dim": d, "bags": b, "bag_size": length, "dtype": t}
        for i, (key, (n, d, b, length, t)) in enumerate(shapes.items())
    ]
    result = _bench_cases.torch_child(cases, "cpu", opts)
    assert result["ok"] is True, result
    assert result["device"] == "cpu" and result["timer"] == "wall clock"
    assert result["torch_version"] and set(result["results"]) == set(shapes)
    for case in cases:
        entry = result["results"][case["key"]]
        assert entry["errors"] == {}
        for kind in ("fwd", "fwd_bwd"):
            assert entry[kind]["repeats"] == 2
            assert 0 < entry[kind]["min_ms"] <= entry[kind]["median_ms"]
        # The child's data and output: the bag sums and the weights gradient, in numpy.
        data = _bench_torch.bag_data(
            case["seed"], case["rows"], case["dim"], case["bags"], case["bag_size"]
        )
        table, ids = data["table"].astype(np.float64), data["ids"][0]
        weights, upstream = data["weights"].astype(np.float64), data["upstream"]
        bags = (table[ids] * weights[..., None]).sum(axis=1)
        weights_grad = (table[ids] * upstream.astype(np.float64)[:, None, :]).sum(axis=-1)
        count = min(case["bags"], _bench_torch.CHECK_BAGS)
        tolerance = 1e-12 if case["dtype"] == "float64" else 1e-5
        (out,) = entry["check"]["fwd"]
        np.testing.assert_allclose(out, bags[:count], atol=tolerance * np.abs(bags).max())
        out, grad = entry["check"]["fwd_bwd"]
        np.testing.assert_allclose(out, bags[:count], atol=tolerance * np.abs(bags).max())
        scale = np.abs(weights_grad).max()
        np.testing.assert_allclose(grad, weights_grad[:count], atol=tolerance * scale)


def test_torch_child_row_compares_with_the_baseline():
    if not HAVE_TORCH:
        pytest.skip("torch is not installed (pip install torch): the child runs where it is")
    (opts,) = _runs("--quick", "--rows", "60", "--dim", "4", "--bags", "10", "--bag-size", "3")
    opts.torch_mode = "off"
    item = bench.Item(opts, "gather_reduce_sum", "float64", None)
    case = bench.build(item)
    spec = {"key": "k", "seed": item.seed, "rows": 60, "dim": 4, "bags": 10, "bag_size": 3}
    result = _bench_cases.torch_child([dict(spec, dtype="float64")], "cpu", opts)
    row = _bench_cases.torch_child_row(case, result["results"]["k"], result["timer"])
    assert row["impl"] == "torch" and row["timer"] == "wall clock" and not row["baseline"]
    assert row["fwd_in_graph"] is None and row["fwd"]["median_ms"] > 0
    assert set(row["max_rel_diff"]) == {"fwd", "fwd_bwd"}
    assert max(row["max_rel_diff"].values()) < 1e-12, row["max_rel_diff"]


@pytest.mark.parametrize(
    "mode,line", [("child", "the child process failed"), ("auto", "does not import")]
)
def test_a_failing_torch_prints_one_line_and_the_command_goes_on(tmp_path, mode, line):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("this torch is broken on purpose")\n')
    proc = _run(
        "--quick",
        "--cases",
        "gather_reduce_sum",
        "--torch",
        mode,
        "--rows",
        "100",
        "--dim",
        "4",
        "--bags",
        "5",
        "--bag-size",
        "3",
        "--repeats",
        "1",
        pythonpath=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [text for text in proc.stdout.splitlines() if text.startswith("torch")]
    assert len(notes) == 1, proc.stdout
    assert line in notes[0] and "RuntimeError: this torch is broken on purpose" in notes[0]
    assert notes[0].endswith("so not timed")
    assert " torch " not in proc.stdout.split("Per lookup")[0]  # no torch row


def test_missing_torch_is_one_note(monkeypatch):
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    args = _parse("--quick")
    notes = []
    items = bench.plan([bench.resolve(args, None)])
    assert bench.torch_mode(args, items, notes) == "off"
    assert len(notes) == 1 and notes[0].startswith("torch: not installed, so not timed")
    assert bench.torch_device("GPU:1") == "cuda:1" and bench.torch_device("/device:CPU:0") == "cpu"


# ----------------------------------------------------------------------------------------
# GPU: the presets, small, with torch in its child process.


@pytest.mark.gpu
def test_presets_on_the_gpu(tmp_path):
    path = tmp_path / "gpu.json"
    proc = _run(
        "--preset",
        "dlrm,fbtt",
        "--quick",
        "--device",
        "GPU:0",
        "--repeats",
        "2",
        "--tt-bags",
        "16",
        "--json",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(path.read_text())
    rows = {(r["label"], r["impl"]): r for r in result["results"]}
    assert {"custom_op", "tf_gather"} <= {i for label, i in rows if label.startswith("dlrm")}
    for r in result["results"]:
        if r["impl"] != "torch":
            assert r["errors"] == {}, r
            # The bench runs with TensorFlow's defaults: TF32 matmuls in the TT composite.
            tolerance = 1e-2 if r["case"] == "tt_bag" else 1e-4
            assert max(r["max_rel_diff"].values()) < tolerance, r
    assert rows[("dlrm:gather_reduce_sum", "custom_op")]["gathered_tb_s"] > 0
    assert rows[("fbtt:tt_bag[16x20]", "custom_op")]["us_per_lookup"]["fwd_bwd"] > 0
    torch_rows = [r for r in result["results"] if r["impl"] == "torch"]
    if torch_rows:  # torch with CUDA, timed in the child process
        assert torch_rows[0]["timer"] == "CUDA events"
        assert result["environment"]["torch"]["device"] == "cuda:0"
    else:
        assert len([n for n in result["notes"] if n.startswith("torch")]) == 1, result["notes"]


def _run_bench_script(script: str, *args: str) -> None:
    """Runs python/bench/<script> with `args` from the checkout; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(CHECKOUT / "python" / "bench" / script), *args],
        cwd=CHECKOUT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_plain_gather_loop_sums_every_dtype_and_width_as_numpy_does(tmp_path):
    """The plain gather-sum loop (python/bench/plain_gather_loop.cc, built for this CPU) sums the
    same exact data for every dtype and prefetch setting, in registers (D = 64) and in
    memory (D = 272, over 16 vectors with AVX-512 or AVX2), as numpy's float64 sum of its
    data's definition; our forward (and torch's, where it imports) is timed beside it."""
    sys.path.insert(0, str(CHECKOUT / "python" / "bench"))
    try:
        import bench_plain_gather_loop
    finally:
        sys.path.pop(0)
    path = tmp_path / "out.json"
    shapes = [(700, 64, 9, 5), (300, 272, 4, 3)]
    _run_bench_script(
        "bench_plain_gather_loop.py",
        *("--shapes", ";".join(",".join(map(str, s)) for s in shapes), "--ours"),
        *("--repeats", "1", "--warmup", "1", "--aheads", "1,3", "--json", str(path)),
        *(["--torch"] if HAVE_TORCH else []),
    )
    cases = json.loads(path.read_text())["cases"]
    assert [tuple(c["shape"]) for c in cases] == shapes
    for shape, case in zip(shapes, cases):
        expected = bench_plain_gather_loop.expected_checksum(shape)
        assert expected != 0
        for dtype in bench_plain_gather_loop.DTYPES:
            assert case["plain_loop"][dtype]["checksums"] == [expected]
            assert case["plain_loop"][dtype]["median_ms"] > 0
            assert case["ours_in_graph_ms"][dtype] > 0
            assert case["torch_ms"][dtype] > 0 if HAVE_TORCH else "torch_ms" not in case


@pytest.mark.parametrize(
    "script,key,names",
    [
        ("bench_report_check.py", "variant", {"op only", "op and check"}),
        (
            "bench_tt_step_parts.py",
            "part",
            {
                "empty",
                "unique",
                "unique+rows",
                "forward",
                "fwd+grad",
                "sgd step",
                "fwd+bwd two ops",
                "fwd+bwd bags grad",
            },
        ),
    ],
)
def test_gpu_breakdown_benches_run_on_the_cpu(tmp_path, script, key, names):
    """The two GPU breakdown programs run (--quick, on the CPU) and time every part per
    call and in graph."""
    path = tmp_path / "out.json"
    _run_bench_script(
        script,
        *("--quick", "--device", "CPU:0", "--repeats", "1", "--steps", "2", "--warmup", "1"),
        *("--json", str(path)),
    )
    results = json.loads(path.read_text())["results"]
    assert {r[key] for r in results} == names
    assert {r["kind"] for r in results} == {"per call", "in graph"}
    assert len(results) == 2 * len(names) * (2 if script == "bench_report_check.py" else 1)
    assert all(r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] for r in results)


def test_tt_bench_times_fwd_bwd_per_call_and_in_graph(tmp_path):
    """python/bench/bench_tt.py runs (one small case) and records the TT fwd+bwd per call
    and in graph, each with its rate and its check against the matmul ceiling."""
    path = tmp_path / "tt.json"
    _run_bench_script(
        "bench_tt.py",
        *("--quick", "--distributions", "uniform", "--no-dense", "--no-fused-sgd"),
        *("--repeats", "2", "--warmup", "1", "--bags", "16", "--bag-size", "3"),
        *("--matmul-size", "128", "--json", str(path)),
    )
    document = json.loads(path.read_text())
    (result,) = document["results"]
    assert result["lookups"] == 48
    per_call, in_graph = result["tt_fwd_bwd"], result["tt_fwd_bwd_in_graph"]
    assert in_graph["repeats"] == 3  # max(3, repeats / 2) calls of 10 steps
    for timing in (per_call, in_graph):
        assert 0 < timing["min_ms"] <= timing["median_ms"]
        flops = result["lookups"] * result["fwd_bwd_flops_per_lookup"]
        assert math.isclose(timing["gflops"], flops / (timing["median_ms"] * 1e-3) / 1e9)
    ceiling = document["matmul"]["gflops"]
    check = document["checks"]["fwd_bwd_in_graph_vs_matmul"]
    assert check["status"] == ("PASS" if in_graph["gflops"] >= 0.4 * ceiling else "MISS")
    assert f"{100 * in_graph['gflops'] / ceiling:.1f}% of" in check["measured"]
    assert "in graph" in check["target"] and "40%" in check["target"]


def test_machine_info_records_the_settings_that_change_results(monkeypatch):
    """Benchmark JSON records the thread-pool and CPU-path variables that are set, with
    their values, and none that are not."""
    from tf_ttemb import _timing

    for name in _timing.RESULT_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert _timing.machine_info()["environment"] == {}
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "1")
    monkeypatch.setenv("TF_TTEMB_CPU_ISA", "avx2")
    monkeypatch.setenv("TF_TTEMB_UNRELATED", "x")
    assert _timing.machine_info()["environment"] == {
        "TF_NUM_INTEROP_THREADS": "1",
        "TF_TTEMB_CPU_ISA": "avx2",
    }
    assert _timing.environment_suffix() == ", TF_NUM_INTEROP_THREADS=1, TF_TTEMB_CPU_ISA=avx2"


def test_timed_calls_run_with_the_collector_paused():
    """The timed calls run with Python's garbage collector off (as timeit's do), the
    warm-up calls with it as it was; it is on again afterwards, also after a call raises."""
    import gc

    from tf_ttemb import _timing

    seen = []
    _timing.time_calls(lambda: seen.append(gc.isenabled()), warmup=2, repeats=3)
    assert seen == [True, True, False, False, False]
    seen.clear()
    timings = _timing.time_alternating(
        {"a": lambda: seen.append(gc.isenabled()), "b": lambda: seen.append(gc.isenabled())},
        warmup=1,
        repeats=2,
    )
    assert seen == [True, True, False, False, False, False]
    assert sorted(timings) == ["a", "b"] and timings["a"].repeats == 2
    assert gc.isenabled()

    def fails():
        if not gc.isenabled():
            raise RuntimeError("timed call")

    with pytest.raises(RuntimeError, match="timed call"):
        _timing.time_calls(fails, warmup=1, repeats=1)
    assert gc.isenabled()
    # torch's side of the bench (its CPU timing needs no torch module) times alike.
    seen.clear()
    timed = _bench_torch._time_calls(None, lambda: seen.append(gc.isenabled()), False, 1, 2)
    assert seen == [True, False, False] and timed["repeats"] == 2
    assert gc.isenabled()


def test_chained_steps_run_one_after_the_other():
    """The in-graph timing loop sums `steps` results of its step, its iterations not allowed
    to overlap (parallel_iterations=1; by default up to 10 independent ones run at once)."""
    from tf_ttemb import _timing

    counter = tf.Variable(0.0)

    def step():
        counter.assign_add(1.0)
        return tf.constant(2.5)

    loop = _timing.chained_steps(tf, step, 7)
    assert float(loop()) == 17.5 and float(counter.numpy()) == 7.0
    whiles = [
        op
        for op in loop.get_concrete_function().graph.get_operations()
        if op.type in ("While", "StatelessWhile")
    ]
    assert [op.get_attr("parallel_iterations") for op in whiles] == [1]


def test_torch_side_times_without_importing_tensorflow():
    """As the bench's child script, tf_ttemb/_bench_torch.py loads the timing utility from
    its file: timing a call imports neither TensorFlow nor the tf_ttemb package."""
    script = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("bench_torch", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
timed = module._time_calls(None, lambda: None, False, 1, 3)
print(timed["repeats"], "tensorflow" in sys.modules, "tf_ttemb" in sys.modules)
"""
    last = run_fresh_python(script, _bench_torch.__file__, without_tf_ttemb=True)
    assert last == "3 False False", last
