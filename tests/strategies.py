"""Hypothesis strategies shared by the test suite (one place, per house style)."""
