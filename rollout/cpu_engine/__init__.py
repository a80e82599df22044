"""The CPU engine: an HTTP server that follows shared/reference/sglang-http.md route by route
over a transformers causal LM on CPU.

It is the engine of the local demo and of the tests. Production runs real SGLang
(`python -m sglang.launch_server`) with the same flags; this package exists because SGLang does
not run on CPU-only machines. Start it with `python -m rollout.cpu_engine --model-path P --port N`.
"""
