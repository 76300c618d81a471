"""The click commands, one module per section of `neffbuild --help` (as cli/views/ has their
views): each parses, calls one core function and hands its result to a view."""
