"""A model whose input is strings (TextVectorization -> Embedding -> ...) under `pserver run --ps 1
--workers 2`: each worker adapts the layer on the texts it holds whole (the same vocabulary on every
worker, docs/semantics.md), runs it on its data before the model, and trains ids. (A worker whose
vocabulary differs is refused: its ids differ from the job's data fingerprint, and its layout's
signature from the shards', tests/test_text.py; checked by hand in development, not here, to keep
the e2e time small.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = """
import json, os
import numpy as np
import pserver.keras as keras
from pserver.keras import layers
rank, out = int(os.environ["PSERVER_RUN_RANK"]), os.environ["OUT_DIR"]
rng = np.random.default_rng(0)
words = np.array([f"w{i}" for i in range(20)])
y = rng.integers(0, 2, 128)
x = np.array([" ".join([*rng.choice(words, 5), "good" if v else "bad"]) for v in y])
vec = layers.TextVectorization(max_tokens=32, output_sequence_length=8)
vec.adapt(x)
inputs = keras.Input(shape=(1,), dtype="string")
h = layers.GlobalAveragePooling1D()(layers.Embedding(32, 4)(vec(inputs)))
model = keras.Model(inputs, layers.Dense(2, activation="softmax")(h))
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
h = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
with open(os.path.join(out, f"run{rank}.json"), "w") as f:
    json.dump({"vocabulary": vec.get_vocabulary(), "loss": h.history["loss"],
               "weights": [w.tolist() for w in model.get_weights()],
               "predict": model.predict(x[:4], verbose=0).tolist()}, f)
"""


def test_string_input_trains_on_a_cluster_with_one_vocabulary(tmp_path):
    """Both workers adapt on the whole texts: one vocabulary, the same History and final weights,
    predict on strings. Catches strings reaching the loop or the wire, workers whose ids differ."""
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = [json.loads((tmp_path / f"run{rank}.json").read_text()) for rank in range(2)]
    assert runs[0]["vocabulary"] == runs[1]["vocabulary"] and runs[0]["vocabulary"][:2] == ["", "[UNK]"]
    assert runs[0]["loss"] == runs[1]["loss"] and runs[0]["weights"] == runs[1]["weights"]
    assert runs[0]["predict"] == runs[1]["predict"]

