# Copied unchanged from THUDM/slime (https://github.com/THUDM/slime) at 624b824a898ab0ec1fcb4d373004c7f3852bf515,
# examples/multi_agent/__init__.py. Copyright the slime authors, under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0), slime's LICENSE. Run by tests/rollout/test_slime_examples.py.
