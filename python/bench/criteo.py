"""The Criteo-like grouped config of the grouped benchmarks (bench_grouped.py, trace_grouped.py
and python/gpu_harness/bench_grouped_kernels.py), without TensorFlow: 26 tables of D = 64,
row counts from 10 to 10M, 23 one-hot features and 3 multi-hot features of 20 ids."""

# Criteo's (Kaggle) 26 categorical cardinalities, rounded.
CRITEO_ROWS = [
    1460,
    583,
    10_131_227,
    2_202_608,
    305,
    24,
    12_517,
    633,
    3,
    93_145,
    5_683,
    8_351_593,
    3_194,
    27,
    14_992,
    5_461_306,
    10,
    5_652,
    2_173,
    4,
    7_046_547,
    18,
    15,
    286_181,
    105,
    142_572,
]
MULTI_HOT = {2: 20, 11: 20, 20: 20}  # feature -> bag size (the three largest tables)
DIM = 64
