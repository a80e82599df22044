"""The rollout's own failure, raised where a round cannot go on (a request no engine answers, a
plug-in that breaks its contract)."""


class RolloutError(RuntimeError):
    pass
