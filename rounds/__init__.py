"""The round core: what a round of a session decides, at the gateway and in an engine's steps. Pure: no I/O."""
