"""Moved to pserver.wire.frames, pserver.server.dataplane and pserver.worker.dataplane: this
path warns and goes away in the next release."""

from pserver._moved import forward

__getattr__ = forward(__name__)
