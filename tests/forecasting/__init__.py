"""Tests of the forecasting package (mining, forecasting, planning, replay)."""
