"""``--trainer.plugins lit_minimind.precision.CPUFloat16Mixed``: the short name of
:class:`lit_minimind.model.precision.CPUFloat16Mixed`."""

from lit_minimind.model.precision import CPUFloat16Mixed

__all__ = ["CPUFloat16Mixed"]
