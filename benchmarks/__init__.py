"""Benchmarks of lit-minimind: port overhead, checkpoint cost, resume cost (``make bench``)."""
