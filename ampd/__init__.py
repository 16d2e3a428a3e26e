"""The `ampd` command line and the local stack it starts."""
