"""The package's version, importable by every stage without the package's own __init__."""

__version__ = "0.1.0"
