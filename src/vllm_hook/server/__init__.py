"""Served mode (`vllm serve`): HTTP routes, result retention and response encoding.

Nothing here reads vLLM internals; the patches of vLLM's API server live in
`adapters/server.py` and call into this package.
"""
