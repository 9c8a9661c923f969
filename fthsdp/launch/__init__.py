"""Launchers: local processes with fault injection; Ray clusters."""
