"""What is stored and exchanged: manifests, records (bundle, release, tag), and resolving them in a store."""
