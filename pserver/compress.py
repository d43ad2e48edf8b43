"""Moved to pserver.wire.compress, pserver.worker.compress and pserver.server.compress: this
path warns and goes away in the next release."""

from pserver._moved import forward

__getattr__ = forward(__name__)
