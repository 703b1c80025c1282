"""Paged attention backends: read and write K/V through block tables."""
