"""Moved to pserver.observe.telemetry: this path warns and goes away in the next release."""

from pserver._moved import forward

__getattr__ = forward(__name__)
