"""neffbuild: build, publish and pull compiled-model caches for static-shape pipelines."""

__version__ = "0.1.0"
