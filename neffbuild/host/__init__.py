"""What runs on a serving host: the cache dir, its state and exports, pull, status, doctor, verify."""
