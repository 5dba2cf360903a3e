"""Keras 3 layers of tf_ttemb."""

from tf_ttemb.layers.embedding_bag import EmbeddingBag
from tf_ttemb.layers.grouped_embedding_bag import GroupedEmbeddingBag
from tf_ttemb.layers.product_key_memory import ProductKeyMemory
from tf_ttemb.layers.tt_embedding_bag import TableBatchedTTEmbeddingBag, TTEmbeddingBag

__all__ = [
    "EmbeddingBag",
    "GroupedEmbeddingBag",
    "ProductKeyMemory",
    "TTEmbeddingBag",
    "TableBatchedTTEmbeddingBag",
]
