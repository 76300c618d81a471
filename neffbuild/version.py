"""The package's version, importable by every stage without the package's own __init__."""

__version__ = "0.1.0"


def installed_version(distribution: str) -> str:
    """An installed distribution's version, "" when it is not installed. Read from the header of
    its METADATA: importlib.metadata.version parses the whole file, long description included
    (13 ms for transformers'), and plan asks for several on every run."""
    from importlib import metadata

    try:
        found = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return ""
    header = (found.read_text("METADATA") or found.read_text("PKG-INFO") or "").partition("\n\n")[0]
    for line in header.splitlines():
        if line.startswith("Version:"):
            return line.removeprefix("Version:").strip()
    return found.version or ""
