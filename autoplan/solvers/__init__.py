"""Solvers over plain problem data; no torch here.

Intra-operator (one logical mesh): the problem (`problem`), Alpa's ILP over it (`ilp`), and
an assignment's cost recomputed apart from any solver (`evaluate`). Inter-operator (pipeline
stages): the problem (`stage_problem`), its cost tables (`stage_tables`), Alpa's dynamic
program for one cap on the stage time (`stage_dp`) and the search over caps (`stages`).
"""
