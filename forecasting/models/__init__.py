"""Forecasting models: the shared interface (``base``), the model catalogue (``catalog``),
intermittent-demand models (``intermittent``), ensembles (``ensemble``), per-series selection by
backtest (``selection``) and fitting across processes (``parallel``)."""
