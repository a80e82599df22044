"""The RL trainer step: loop driver, losses, backends, checkpoints, weight publishing."""
