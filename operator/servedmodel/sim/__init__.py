"""A vLLM-0.33-compatible engine simulator: its HTTP API, metrics and errors, and scheduler dynamics, no GPU.

Run it with `servedmodel sim` (see cli.py); start it from tests with `servedmodel.sim.process`.
"""
