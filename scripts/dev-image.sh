#!/usr/bin/env bash
# Build harness-worker:dev, the image the docker backend uses for development and CI, from what is on this machine.
#
# No registry is reachable here, so nothing is pulled: the image is a root filesystem skeleton (the host's /usr
# symlink layout, a root user, /tmp) imported with `docker import`. At run time the docker backend bind-mounts the
# host's /usr, Python environment and this repository read-only (the image's `harness.host-python` label tells it
# to), so a container runs the same interpreter, torch and code as the harness itself. Idempotent: an existing
# image is kept; pass --rebuild to replace it. For real GPU hosts build compose/Dockerfile instead.
set -euo pipefail

IMAGE="${HARNESS_DOCKER_IMAGE:-harness-worker:dev}"

if [[ "${1:-}" != "--rebuild" ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE is present (scripts/dev-image.sh --rebuild replaces it)"
    exit 0
fi

rootfs="$(mktemp -d)"
chmod 755 "$rootfs"
trap 'rm -rf "$rootfs"' EXIT
mkdir -p "$rootfs"/{etc,tmp,root,proc,sys,dev}
chmod 1777 "$rootfs/tmp"
# Merged-/usr hosts have /bin, /lib, ... as symlinks into /usr: the same links make the mounted /usr complete.
# Where one of them is a real directory instead, the backend mounts it.
for dir in bin sbin lib lib32 lib64 libx32; do
    if [[ -L "/$dir" ]]; then
        ln -s "$(readlink "/$dir")" "$rootfs/$dir"
    fi
done
echo 'root:x:0:0:root:/root:/bin/sh' >"$rootfs/etc/passwd"
echo 'root:x:0:' >"$rootfs/etc/group"

tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'LABEL harness.host-python=true' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --message "harness development image: runs the host's Python through read-only bind mounts" \
    - "$IMAGE"
echo "built $IMAGE"
