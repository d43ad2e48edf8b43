"""A process started by `pserver launch` (the local backend) or `pserver run`:

    python -m pserver.launch.child serve|worker CONFIG_FILE [--wait]

runs that role on the config the launcher wrote to CONFIG_FILE (pserver.launch.local), with
the token from its environment, and exits with the role's code. With --wait the file is not
there yet: the process imports what the role needs, then waits for it (`pserver run` starts its
shards so, before a worker's fit says their settings), for as long as its launcher lives.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

from pserver.launch.roles import ROLES, preload, run_role
from pserver.signals import exiting_after, follow_parent

WAIT_POLL = 0.01      # seconds between looks for a --wait config


def main(argv: list[str]) -> int:
    follow_parent()                            # stop when the launcher dies
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    wait = argv[2:] == ["--wait"]
    if len(argv) != 2 + wait or argv[0] not in ROLES:
        print(f"usage: python -m pserver.launch.child {'|'.join(ROLES)} CONFIG_FILE [--wait]",
              file=sys.stderr)
        return 2
    if wait:
        preload(argv[0])
    while wait and not os.path.exists(argv[1]):
        time.sleep(WAIT_POLL)
    with open(argv[1], "rb") as f:
        cfg = pickle.load(f)
    return exiting_after(run_role(argv[0], cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
