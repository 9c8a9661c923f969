"""Experiment configs: each module defines `config` (an fthsdp.config.Config)."""
