#!/usr/bin/env bash
# The image's entrypoint: the first argument picks the role, the rest are its flags.
#
#   router   ARGS  -> spectandem serve --backend grpc ARGS   (the public server over engine services)
#   drafter  ARGS  -> spectandem drafter ARGS                (the Drafter gRPC service)
#   verifier ARGS  -> spectandem verifier ARGS               (the Verifier gRPC service)
#   serve    ARGS  -> spectandem serve ARGS                  (all in one: Ray actors by default)
#   anything else runs as a command (ray start ..., bash), as the Ray cluster launcher and
#   KubeRay expect of an image.
set -euo pipefail

role="${1:-serve}"
[ "$#" -gt 0 ] && shift
case "$role" in
  router)           exec spectandem serve --backend grpc "$@" ;;
  drafter|verifier) exec spectandem "$role" "$@" ;;
  serve)            exec spectandem serve "$@" ;;
  *)                exec "$role" "$@" ;;
esac
