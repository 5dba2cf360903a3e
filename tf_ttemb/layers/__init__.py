"""Keras 3 layers of tf_ttemb."""

from tf_ttemb.layers.embedding_bag import EmbeddingBag

__all__ = ["EmbeddingBag"]
