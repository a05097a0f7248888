"""Research example app: a clarifier, a brief writer, a researcher with a search tool and a reporter, whose
models answer through OpenAI-style structured output."""
