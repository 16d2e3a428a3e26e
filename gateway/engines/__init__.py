"""The gateway's side of its engines: connections, the worker pool, prompt counts, migration."""
