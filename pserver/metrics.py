"""Moved to pserver.observe.metrics: this path warns and goes away in the next release."""

from pserver._moved import forward

__getattr__ = forward(__name__)
