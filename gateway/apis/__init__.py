"""The HTTP APIs agents speak: OpenAI chat completions and Responses, Anthropic Messages."""
