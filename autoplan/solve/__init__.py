"""Solvers over plain problem data; no torch here."""
