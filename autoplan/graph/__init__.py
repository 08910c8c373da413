"""The graph: models traced into the graph IR (`capture`, `passes`, `diagnose`, `convert`,
`ir`), their FLOPs, repeated layers (`blocks`), and the cuts into layers and stages."""
