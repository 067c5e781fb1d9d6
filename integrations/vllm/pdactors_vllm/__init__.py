"""The vLLM integration: the only code in pdactors that imports vllm or torch."""
