"""Choosing the implementation of an op for a problem: candidate tables, timing, the choice kept per shape."""
