"""Placements, sharding rules and every node's candidate strategies (priced by
`autoplan.costmodel`)."""
