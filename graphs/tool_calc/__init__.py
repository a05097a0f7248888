"""Tool calculator app: a worker that multiplies 4-digit numbers with a `multiply` tool called through the OpenAI
SDK (README.md)."""
