"""Parallelism: the device mesh built from an experiment, and the logical → mesh sharding rules."""
