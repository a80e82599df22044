"""slime's example plug-ins, copied unchanged (each file says from where): tests/rollout/test_slime_examples.py runs them."""
