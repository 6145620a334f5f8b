"""The data-parallel coordinator: what engines register with and clients talk to. It routes
each request to an engine by load and prefix affinity (routing.py), hands each engine's outputs
to the client that asked, and survives engines that join, drain, leave or die (core.py).
Imports no torch."""
