"""Read-only views of a store: `ls`, `show`, `diff`, `du`.

Each command is one function over a store that returns frozen dataclasses; `read` fetches the
documents they need, in parallel (a store of 1,000 releases on S3 must not cost 1,000 sequential
round trips), and parses them strictly, as `pull` does. Nothing here writes to a store.
"""
