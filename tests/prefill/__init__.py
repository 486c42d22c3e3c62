"""Tests of the prefill package (models, schedule, runner, CLI)."""
