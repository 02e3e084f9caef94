"""Collective helpers: gradient buckets, ring exchange, communication accounting."""
