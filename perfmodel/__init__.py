"""The performance model: what a model costs on a GPU type at a TP degree (the ground floor)."""
