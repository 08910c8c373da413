"""Capture: models into the graph IR, and repeated layers."""
