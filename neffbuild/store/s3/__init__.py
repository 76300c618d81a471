"""The S3 store: a botocore client for writes, a urllib3 data plane for reads, packs of small blobs."""
