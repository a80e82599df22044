"""slime's plug-in API, at slime's import paths, so a plug-in written for slime imports unchanged:

    from slime.utils.http_utils import post, get
    from slime.utils.types import Sample
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

Only what plug-ins import lives here; it is slurmrl's own code under slime's names (install slime
itself beside slurmrl and one would shadow the other).
"""
