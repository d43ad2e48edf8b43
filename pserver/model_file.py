"""Moved to pserver.models.saved (evaluate_files: pserver.api): this path warns and goes away
in the next release."""

from pserver._moved import forward

__getattr__ = forward(__name__)
