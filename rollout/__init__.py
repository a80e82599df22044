"""Rollout: engine launch commands, router client, data, rewards and generate_rollout."""
