"""The asynchronous save's snapshot: a true copy, shared tensors kept shared, buffers reused by shape."""

from __future__ import annotations

import torch

from lit_minimind.resume.io import Snapshot


def test_snapshot_is_a_copy_that_keeps_shared_tensors_shared() -> None:
    weight = torch.randn(4, 3)
    state = {"state_dict": {"w": weight, "tied": weight}, "optimizer": [{"m": torch.zeros(3)}], "step": 7}
    copy = Snapshot()(state)
    assert copy["step"] == 7 and torch.equal(copy["state_dict"]["w"], weight)
    assert copy["state_dict"]["w"] is copy["state_dict"]["tied"]  # torch.save writes it once, as for the original
    weight.add_(1.0)  # training goes on while the copy is written
    assert not torch.equal(copy["state_dict"]["w"], weight)


def test_buffers_are_reused_by_shape_when_the_state_changes_shape() -> None:
    """A save with partial gradients after one without (or the reverse) reuses every buffer that fits."""
    snapshot = Snapshot()
    weights, moments = torch.randn(8, 4), torch.randn(8, 4)
    first = snapshot({"w": weights, "m": moments})
    pointers = {first["w"].data_ptr(), first["m"].data_ptr()}
    grads = torch.randn(2, 2)
    second = snapshot({"grads": grads, "w": weights, "m": moments})  # a new tensor comes first
    assert {second["w"].data_ptr(), second["m"].data_ptr()} == pointers
    assert second["grads"].data_ptr() not in pointers and torch.equal(second["grads"], grads)
    assert snapshot.nbytes == (2 * 32 + 4) * 4
    third = snapshot({"w": weights})  # what the next snapshot has no tensor for is let go
    assert third["w"].data_ptr() in pointers and snapshot.nbytes == 32 * 4
