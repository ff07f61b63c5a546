"""The seam with Lightning: where training stands (position), what Lightning cannot restore alone
(loop counters for foreign positions, per-rank RNG), the CheckpointIO plugin,
and the plain-PyTorch course API."""
