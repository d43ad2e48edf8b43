"""Moved to pserver.worker.stragglers (parse_delay: pserver.config): this path warns and goes
away in the next release."""

from pserver._moved import forward

__getattr__ = forward(__name__)
