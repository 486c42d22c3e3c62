"""Mining request logs and forecasting prefix demand (arrives with the forecasting issue)."""
