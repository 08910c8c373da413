"""Placements, sharding rules and the cost of each strategy."""
