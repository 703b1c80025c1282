"""Structured outputs (constrained decoding) with llguidance; see ``manager.py``."""

from inflight.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
