"""`spectandem bench`: the benchmark command (command.py) and its sections. An entry point: it
builds the drafter, the verifier and the router in one process to measure them, so it is the one
part of `spectandem/` that imports the roles (tests/test_layers.py)."""
