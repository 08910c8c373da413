"""Execution: run a plan with torch.distributed (DTensor) under torchrun."""
