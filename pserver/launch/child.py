"""A process started by `pserver launch` (the local backend):

    python -m pserver.launch.child serve|worker CONFIG_FILE

runs that role on the config the launcher wrote to CONFIG_FILE (pserver.launch.local), with
the token from its environment, and exits with the role's code.
"""

from __future__ import annotations

import os
import pickle
import sys

from pserver.launch.roles import ROLES, run_role
from pserver.signals import exiting_after, follow_parent


def main(argv: list[str]) -> int:
    follow_parent()                            # stop when the launcher dies
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if len(argv) != 2 or argv[0] not in ROLES:
        print(f"usage: python -m pserver.launch.child {'|'.join(ROLES)} CONFIG_FILE", file=sys.stderr)
        return 2
    with open(argv[1], "rb") as f:
        cfg = pickle.load(f)
    return exiting_after(run_role(argv[0], cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
