"""A Keras script with a learning-rate schedule, clipvalue and a kernel regularizer under
`pserver run --ps 1 --workers 2`, sync. The samples are all alike, so every batch's gradient
is the same whichever worker trains it, and the schedule (PiecewiseConstantDecay: 0.05 at step
0, then 0) lets only the first update move the weights: they end at Keras's SGD step
w0 - 0.05 * clip(g(w0) + the penalty's gradient), in NumPy. Catches: the schedule or
clipvalue not reaching the shards `pserver run` starts from the compiled optimizer (a
constant rate would go on moving them, unclipped), the penalty's gradient lost. (How many
steps an epoch takes depends on how the leases share the data: docs/semantics.md.)"""

from __future__ import annotations

import json
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
keras.utils.set_random_seed(7)
rng = np.random.default_rng(0)
x = np.tile(rng.normal(size=(1, 3)), (32, 1)).astype("float32")
y = np.full((32, 1), 5.0, "float32")
schedule = keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.05, 0.0])
model = keras.Sequential([keras.Input(shape=(3,)),
                          layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)),
                          layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(schedule, clipvalue=0.5), loss="mse")
w = np.concatenate([a.ravel() for a in model.get_weights()])
g = np.empty_like(w)
model._core.loss_and_grad(w, x, y, g)
want = w - np.float32(0.05) * np.clip(g, -0.5, 0.5)
assert (np.abs(g) > 0.5).any() and schedule(1) == 0.0
model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
have = np.concatenate([a.ravel() for a in model.get_weights()])
if int(os.environ["PSERVER_RUN_RANK"]) == 0:
    with open(os.environ["OUT_FILE"], "w") as f:
        json.dump({"start": w.tolist(), "have": have.tolist(), "want": want.tolist()}, f)
"""


def test_schedule_clip_and_regularizer_reach_the_cluster_pserver_run_starts(tmp_path):
    script, out = tmp_path / "sched.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_FILE": str(out)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = {k: np.array(v) for k, v in json.loads(out.read_text()).items()}
    assert np.abs(result["have"] - result["start"]).max() > 0.02        # it trained
    np.testing.assert_allclose(result["have"], result["want"], rtol=1e-4, atol=1e-5)
