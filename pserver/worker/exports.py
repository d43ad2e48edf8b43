"""The chief's exports while it trains (--export-every SEC --export-dir DIR): every SEC seconds it
asks every shard to checkpoint (they need --checkpoint-dir, one directory all of them write, as
`pserver launch` gives them) and writes what the checkpoints hold: the first time a whole model,
DIR/model, then a delta since the one before into DIR/deltas (pserver.persist.export.DeltaChain).
`pserver serve-model DIR/model --follow DIR/deltas` serves it as it learns. A thread beside the
training loop; a failed export (no checkpoint directory, a full disk) is said once and training
goes on, as a failed checkpoint does. The run's end writes a last one."""

from __future__ import annotations

import os
import threading

from pserver.errors import ConfigError, PServerError
from pserver.persist import export


class ChiefExports:
    def __init__(self, cfg, client, mode: str, say=print) -> None:
        self.every, self.dir, self.client, self.mode, self.say = cfg.export_every, cfg.export_dir, client, \
            mode, say
        self.options = vars(cfg)       # the model an export is of: this run's, built from its flags
        self.base = os.path.join(self.dir, "model")
        self.deltas = os.path.join(self.dir, "deltas")
        self.chain: export.DeltaChain | None = None
        self.said: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ps-export", daemon=True)

    def start(self) -> ChiefExports:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.once()

    def once(self) -> str | None:
        """Checkpoint every shard, then write the model or the next delta; the path written, or
        None (nothing newer, or a failure, said once per kind)."""
        try:
            answers = self.client.checkpoint()
            dirs = {os.path.dirname(os.path.abspath(p)) for p, _ in answers if p}
            if not answers or any(not p for p, _ in answers) or len(dirs) != 1:
                raise ConfigError("--export-every: the chief exports what the shards' checkpoints hold; "
                                  "start every shard with the same --checkpoint-dir (pserver launch "
                                  f"--checkpoint-dir DIR does); they answered {[p for p, _ in answers]}")
            directory = dirs.pop()
            if self.chain is None:
                os.makedirs(self.dir, exist_ok=True)
                if not os.path.exists(self.base):
                    export.export_checkpoints(directory, self.base, self.options, self.mode)
                    self.say(f"--export-every: exported the model to {self.base}; deltas follow in "
                             f"{self.deltas} (pserver serve-model {self.base} --follow {self.deltas})")
                self.chain = export.DeltaChain(directory, self.base, self.deltas, self.options, self.mode,
                                               self.options.get("export_keep_deltas") or 0)
                return self.base
            result = self.chain.step()
            return None if result is None else result["path"]
        except (PServerError, OSError) as e:
            line = f"--export-every: {' '.join(str(e).split())}; training goes on"
            if line not in self.said:
                self.said.add(line)
                self.say(line)
            return None

    def stop(self) -> None:
        """Stop the thread (an export under way finishes)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def close(self) -> None:
        """Stop the thread and write the last export (the run's final state)."""
        self.stop()
        self.once()
        if self.chain is not None:
            self.say(f"--export-every: {self.chain.written} delta(s) written into {self.deltas}")
