"""Prefect flows and deployments (arrives with the flows issue). Nothing imports this package."""
