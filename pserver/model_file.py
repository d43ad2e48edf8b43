"""Moved to pserver.persist.model_file (evaluate_files: pserver.api): this path warns and goes away
in the next release."""

from pserver._moved import forward

__getattr__ = forward(__name__)
