#!/usr/bin/env bash
# Makes the Trellis CPU runtime image from files on this machine, without
# pulling any base image: for CI and for hosts with no registry access.
# (With a registry, `podman build -f deploy/container/Containerfile .` makes
# the same layout from debian:12; docs/deploy.md, "Containers".)
#
#   deploy/container/build-local-image.sh BUILD_DIR TAG
#
# BUILD_DIR is a configured and built Trellis build tree (elastic-run,
# hybrid_training and parameter_server built in it); TAG the image name to
# commit, e.g. localhost/trellis:dev. assemble-rootfs.sh lays out the root
# filesystem in a temp dir (the binaries, their ldd closure, a minimal /etc;
# see there), then `buildah from scratch`, `buildah copy`, `buildah config`
# and `buildah commit` make the image. buildah and podman read the same
# containers/storage, so podman sees the image afterwards; set
# CONTAINERS_STORAGE_CONF to use another store (tests/deploy/container_test.sh
# does: vfs in a temp dir).
set -euo pipefail

if (($# != 2)); then
  echo "usage: $0 BUILD_DIR TAG" >&2
  exit 2
fi
build=$(realpath "$1")
tag=$2
here=$(realpath "$(dirname "$0")")
if ! command -v buildah >/dev/null 2>&1; then
  echo "build-local-image: buildah not found (deploy/install-deps.sh installs it)" >&2
  exit 2
fi

work=$(mktemp -d /tmp/trellis-image.XXXXXX)
ctr=
cleanup() {
  local rc=$?
  if [[ -n $ctr ]]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
root=$work/rootfs
"$here/assemble-rootfs.sh" "$build" "$root"

ctr=$(buildah from scratch)
buildah copy --quiet "$ctr" "$root" / >/dev/null
buildah config \
  --env PATH=/opt/trellis/bin:/opt/trellis/libexec:/usr/bin \
  --env LD_LIBRARY_PATH=/opt/trellis/lib \
  --workingdir /tmp \
  --entrypoint '["/opt/trellis/bin/trellis-entrypoint"]' \
  --cmd '["elastic-run", "--help"]' \
  --label org.opencontainers.image.title=trellis \
  --label org.opencontainers.image.description="Trellis runtime (CPU): elastic-run and the examples" \
  --label org.opencontainers.image.version="$(cat "$root/opt/trellis/VERSION")" \
  "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
ctr=
echo "build-local-image: committed $tag"
