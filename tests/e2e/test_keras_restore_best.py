"""EarlyStopping(restore_best_weights=True) under `pserver run --ps 1 --workers 2` (sync): at the
end of fit every worker's model holds the best epoch's weights (the chief's copy, which it wrote
to the shards), and so does the shard (its checkpoint written after the run's end)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
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
x = rng.normal(size=(320, 4)).astype("float32"); y = (x[:, 0] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(2, activation="softmax")])
model.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy")
score = keras.callbacks.LambdaCallback(          # a monitored value this test controls: best at epoch 2
    on_epoch_end=lambda epoch, logs: logs.__setitem__("score", [3.0, 1.0, 2.0, 4.0][epoch]))
stop = keras.callbacks.EarlyStopping(monitor="score", mode="min", patience=10, restore_best_weights=True)
best = keras.callbacks.ModelCheckpoint(os.path.join(out, "best.keras"), monitor="score", mode="min",
                                       save_best_only=True)
last = keras.callbacks.ModelCheckpoint(os.path.join(out, "last.keras"))
h = model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[score, stop, best, last])
np.savez(os.path.join(out, f"final{rank}.npz"), *model.get_weights())
with open(os.path.join(out, f"h{rank}.json"), "w") as f:
    json.dump({"epoch": h.epoch, "best_epoch": stop.best_epoch, "stopped": stop.stopped_epoch}, f)
"""


def test_every_worker_and_the_shard_end_with_the_best_epoch_s_weights(tmp_path):
    """The score is best after epoch 2 of 4 and patience never runs out: both workers train all 4
    epochs, then both models and the shard hold the weights the chief saved after epoch 2 (not
    epoch 4's). Catches: the restore refused or skipped under pserver run, a worker keeping the
    final weights or a copy that is not the chief's, the shard left at the final weights (a later
    fit would start from them), the wrong epoch restored."""
    from pserver import keras
    from pserver.persist import checkpoint
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2",
                        "--checkpoint-dir", str(tmp_path / "ck"), "--", sys.executable,
                        str(tmp_path / "s.py")],
                       capture_output=True, text=True, timeout=120, env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"h{rank}.json").read_text()) == \
            {"epoch": [0, 1, 2, 3], "best_epoch": 1, "stopped": 0}
    best_model = keras.models.load_model(tmp_path / "best.keras")
    best, last = best_model.get_weights(), keras.models.load_model(tmp_path / "last.keras").get_weights()
    assert not all(np.array_equal(a, b) for a, b in zip(best, last))
    for rank in range(2):
        final = np.load(tmp_path / f"final{rank}.npz")
        assert all(np.array_equal(final[f"arr_{i}"], b) for i, b in enumerate(best)), rank
    shard, _ = checkpoint.newest(str(tmp_path / "ck"), 0, 1)
    views = best_model._core.layout.views(shard.params)
    assert all(np.array_equal(views[t.name], b) for t, b in zip(best_model._core.layout.tensors, best))
    assert re.search(r"\[ps0\] .*shard 0: weights assigned by the chief at version \d+", r.stdout), r.stdout
