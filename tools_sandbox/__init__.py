"""Server-side tools (python, retrieve, calculator) run in a sandbox by rq workers."""
