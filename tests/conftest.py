"""Shared fixtures: a per-test seeded generator and the `gpu` marker's skip."""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# The tests compare float32 results with float64 references at float32 tolerances. On
# GPUs with TensorFloat-32 (Ampere and later) TensorFlow runs float32 matmuls (the PKM
# query projection, the Dense layers around an embedding) with 10-bit mantissas by
# default, which no float32 tolerance holds; the tests switch it off (README: "TF32").
tf.config.experimental.enable_tensor_float_32_execution(False)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fresh data per test, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    if tf.config.list_physical_devices("GPU"):
        return
    skip = pytest.mark.skip(reason="no GPU visible to TensorFlow")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
