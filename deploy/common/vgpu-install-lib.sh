#!/bin/bash
# Install the files of this image's library directory into a host directory without ever
# writing into a file that a running process may map.
#
#   vgpu-install-lib.sh DEST_DIR            HAMi: as /k8s-vgpu/bin/vgpu-init.sh, from postStart;
#                                           HAMi's DRA driver: as /usr/bin/vgpu-init.sh, likewise
#   vgpu-install-lib.sh DEST_DIR -- CMD...  install, then exec CMD (Volcano: the image's
#                                           entrypoint, so no postStart needs changing)
#   VGPU_SOURCE_DIR=/k8s-vgpu/lib/nvidia    (default; where the image keeps its files: each of
#                                           our images sets it to its own)
#   vgpu-install-lib.sh --detach DEST_DIR   before rolling back to an image whose postStart
#                                           rewrites in place: give every libvgpu.so* in
#                                           DEST_DIR a fresh inode (a copy renamed over it), so
#                                           the in-place copy that follows writes into a file no
#                                           running process maps
#
# bash, not sh: it replaces HAMi's own bash scripts, and the DRA driver's distroless image has
# /bin/bash but may have no /bin/sh. The rest is POSIX (tested under dash too).
#
# Same interface and result as HAMi's vgpu-init.sh (copy what differs, never delete, write
# DEST_DIR/ld.so.preload naming DEST_DIR/libvgpu.so), with one difference that matters: HAMi's
# script and Volcano's `cp -f` rewrite a changed library in place (same inode), so every
# container that maps it sees its code change under it and dies (SIGSEGV/SIGBUS). Here each file
# is copied to a temporary name in DEST_DIR and renamed over the old one: the old inode lives on
# for the containers that map it (their bind mount pins it), new containers get the new file.
set -eu

detach=0
if [ "${1:-}" = "--detach" ]; then
    detach=1
    shift
fi
if [ -z "${1:-}" ] || [ "$1" = "--" ]; then
    echo "Usage: $0 [--detach] <destination_directory> [-- command...]" >&2
    exit 1
fi
SOURCE_DIR="${VGPU_SOURCE_DIR:-/k8s-vgpu/lib/nvidia}"
DEST_DIR="${1%/}"
[ -n "$DEST_DIR" ] || DEST_DIR="/"
shift
then_exec=0
if [ "${1:-}" = "--" ]; then
    then_exec=1
    shift
    [ "$#" -gt 0 ] || { echo "$0: nothing to run after --" >&2; exit 1; }
elif [ "$#" -gt 0 ]; then
    echo "$0: unexpected argument $1 (a command to run goes after --)" >&2
    exit 1
fi
mkdir -p "$DEST_DIR"

# Atomically replace $2 with a copy of $1 (same filesystem: the temporary file is beside it).
replace() {
    tmp="$(dirname "$2")/.$(basename "$2").vgpu-new.$$"
    rm -f "$tmp"
    cp "$1" "$tmp"
    chmod 0755 "$tmp"
    mv -f "$tmp" "$2"
}

if [ "$detach" = 1 ]; then
    for f in "$DEST_DIR"/libvgpu.so*; do
        [ -f "$f" ] && [ ! -L "$f" ] || continue
        replace "$f" "$f"
        echo "Detached (fresh inode, same content): $f"
    done
    exit 0
fi

[ -d "$SOURCE_DIR" ] || { echo "$0: no source directory $SOURCE_DIR (VGPU_SOURCE_DIR)" >&2; exit 1; }
# The turn boards' directory (VGPU_TURN_DIR, as the hook names it), which every plugin mounts
# into each GPU container: HAMi's DRA driver through CDI, which fails the container when the
# host path is missing (its own vgpu-init.sh makes it).
turn_dir="${VGPU_TURN_DIR:-/tmp/vgpulock}"
[ "$turn_dir" = off ] || mkdir -p "$turn_dir"

find "$SOURCE_DIR" -type f | while read -r source_file; do
    relative_path="${source_file#"$SOURCE_DIR"/}"
    # ld.so.preload is written below from DEST_DIR, as HAMi's script does.
    if [ "$relative_path" = "ld.so.preload" ]; then
        continue
    fi
    dest_file="$DEST_DIR/$relative_path"
    mkdir -p "$(dirname "$dest_file")"
    if [ -f "$dest_file" ] && cmp -s "$source_file" "$dest_file"; then
        echo "Skipped (same content): $source_file"
        continue
    fi
    replace "$source_file" "$dest_file"
    echo "Installed (renamed into place): $source_file -> $dest_file"
done

preload="$DEST_DIR/.ld.so.preload.vgpu-new.$$"
printf '%s/libvgpu.so\n' "$DEST_DIR" > "$preload"
chmod 0644 "$preload"
mv -f "$preload" "$DEST_DIR/ld.so.preload"
echo "Updated: $DEST_DIR/ld.so.preload -> $DEST_DIR/libvgpu.so"

if [ "$then_exec" = 1 ]; then
    exec "$@"
fi
