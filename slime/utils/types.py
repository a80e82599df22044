"""slime.utils.types: the Sample plug-ins get and fill in (rollout.sample's)."""

from rollout.sample import Sample, Status

__all__ = ["Sample", "Status"]
