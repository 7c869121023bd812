"""ds4: serve DeepSeek-V4-Flash-architecture models to several clients at once."""

__version__ = "0.1.0"
