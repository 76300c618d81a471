"""Keeping a store healthy: gc and the store check."""
