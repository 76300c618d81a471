"""A manifest expanded against a host: build units and their keys."""
