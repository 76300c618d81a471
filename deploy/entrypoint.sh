#!/usr/bin/env bash
# Container entrypoint: pull the release into the cache dir (a volume, so a restart fetches only
# what is missing), then exec the server with the exports of the release actually installed.
#   docker run -e NEFFBUILD_STORE=s3://bucket/prefix -e NEFFBUILD_RELEASE=flux2-klein-prod \
#     -v neffcache:/var/cache/neffbuild image  python -m my_image_server
set -euo pipefail

: "${NEFFBUILD_STORE:?set NEFFBUILD_STORE (a store directory or s3://bucket/prefix)}"
: "${NEFFBUILD_RELEASE:?set NEFFBUILD_RELEASE (a tag or release id)}"
cache_dir=${NEFFBUILD_CACHE_DIR:-/var/cache/neffbuild/cache}
env_file=${NEFFBUILD_ENV_FILE:-/tmp/neffbuild-serving.env}
neffbuild=${NEFFBUILD_BIN:-neffbuild}

# Non-zero (store down, host mismatch, no room, ...) stops the container: nothing serves half-warm.
# Exit 3 is the store: unreachable, or failing or throttling until --timeout; a restart policy
# (e.g. --restart on-failure) tries again, fetching only what the last try did not land.
"$neffbuild" pull "$NEFFBUILD_RELEASE" --cache-dir "$cache_dir" --env-file "$env_file" \
    --lock-timeout "${NEFFBUILD_LOCK_TIMEOUT:-300}" --timeout "${NEFFBUILD_TIMEOUT:-600}" >/dev/null

# The server gets the exports but not the store's credentials.
unset NEFFBUILD_STORE AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN
set -a
# shellcheck source=/dev/null
. "$env_file"
set +a
exec "$@"
