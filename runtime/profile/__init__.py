"""This machine's cost profile for the cost model: measured (`measure`), cached and turned into
predictions and tuning (`machine`)."""
