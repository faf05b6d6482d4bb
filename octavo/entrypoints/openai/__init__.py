"""The OpenAI-compatible server: protocol, serving, metrics, and the `serve` command."""
