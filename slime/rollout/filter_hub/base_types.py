"""slime.rollout.filter_hub.base_types: what dynamic-sampling filters return."""

from rollout.filters import DynamicFilterOutput

__all__ = ["DynamicFilterOutput"]
