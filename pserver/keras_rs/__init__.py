"""keras_rs: Keras-RS's recommender API on pserver, by its names, arguments and defaults.

    from pserver import keras, keras_rs      # in place of: import keras, keras_rs

    layers   TableConfig, FeatureConfig and DistributedEmbedding (the tables on the shards, a
             sparse table each), EmbedReduce (an Embedding that pools a list), FeatureCross
             (DCN-v2), DotInteraction (DLRM), and BruteForceRetrieval (each query's exact top k
             candidates, on arrays after training)
    losses   InBatchSoftmax: a two-tower retrieval model's loss, over the batch's candidates

Where a parameter server changes what an argument means (placement, table stacking, the
partitions' id counts are a TPU's), docs/guide/recommenders.md says what pserver does with it.
"""

from pserver.keras_rs import layers, losses

__all__ = ["layers", "losses"]
