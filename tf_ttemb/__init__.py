"""tf_ttemb: a fused EmbeddingBag op and Keras 3 layer for TensorFlow.

`tf_ttemb.gather_reduce_sum` is the op, `tf_ttemb.layers.EmbeddingBag` the Keras 3 layer,
`tf_ttemb.grouped_gather_reduce_sum` many features' tables in one lookup,
`tf_ttemb.optimizers` the row-sparse optimizers (`LazyAdam`, `RowWiseAdagrad`) for them,
`tf_ttemb.export_for_serving` a SavedModel of a model using them that stock TensorFlow
serves without the op library.
Importing the package registers the custom ops when the op library loads (so a
SavedModel that uses them can be loaded next). A library built for another TensorFlow
version, C++ ABI or CPU makes the import fail with an ImportError that names both
TensorFlow versions and the rebuild command; a missing library does not (the composite
implementation needs none) and is reported on the first use of the custom op.
"""

__version__ = "0.1.0"

from tf_ttemb import layers, optimizers, tt
from tf_ttemb.ops import _loader
from tf_ttemb.ops.gather_reduce_sum import gather_reduce_sum
from tf_ttemb.ops.grouped import grouped_gather_reduce_sum
from tf_ttemb.ops.tt_embedding import tt_embedding_bag, tt_rows
from tf_ttemb.serving import export_for_serving

_loader.try_load_op_library()

__all__ = [
    "__version__",
    "export_for_serving",
    "gather_reduce_sum",
    "grouped_gather_reduce_sum",
    "layers",
    "optimizers",
    "tt",
    "tt_embedding_bag",
    "tt_rows",
]
