"""Talking to the other ranks: every collective the engine issues, on its own process group with a
timeout and errors that name the failing rank (``collectives``), and tensor parallelism, where a
module's parameters are DTensors and the engine trains their local shards (``tensor_parallel``).
Nothing here knows of buckets, rules or steps; every other room may use it.
"""
