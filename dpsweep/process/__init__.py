"""This process: its identity and liveness, and how a command's process ends."""
