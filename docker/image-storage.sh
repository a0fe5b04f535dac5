# Sourced by docker/test-image.sh and docker/test-compose.sh: where buildah keeps the test image, so
# that podman runs the image that buildah built, from the same storage.
#
# Sets STORAGE_DRIVER (exported), storage (the images and layers) and runroot.
# Environment: STORAGE_DRIVER, HVDTRAIN_IMAGE_STORAGE (see docker/test-image.sh).

# Storage: overlay where the kernel has it (layers hold only their changes), else vfs (every layer
# a full copy of the file system: about 3 GB each here, so a cached build takes tens of GB).
if [[ -z ${STORAGE_DRIVER:-} ]]; then
  if grep -qw overlay /proc/filesystems; then STORAGE_DRIVER=overlay; else STORAGE_DRIVER=vfs; fi
fi
export STORAGE_DRIVER
# The images and layers live outside ~/.cache: buildah 1.28 empties a build container's whole file
# system when a RUN's cache mount target (the Dockerfile's /root/.cache) is a folder above the
# storage on the host (after the RUN it removes the target, and resolves that path to "/").
storage=${HVDTRAIN_IMAGE_STORAGE:-/var/lib/hvdtrain/buildah}/$STORAGE_DRIVER
case $storage/ in
  /root/.cache/*) { echo "HVDTRAIN_IMAGE_STORAGE must not be under /root/.cache (see above)" >&2; exit 1; } ;;
esac
runroot=/run/hvdtrain-buildah-$STORAGE_DRIVER
