#!/usr/bin/env bash
# Assembles the root filesystem of the Trellis CPU runtime image from a
# built Trellis build tree: the binaries, every shared library they load
# (the ldd closure) and a minimal /etc. Used by build-local-image.sh (no
# base image at all) and by the Containerfile's build stage (whose runtime
# stage is FROM scratch with this tree), so both images have one layout:
#
#   /opt/trellis/bin/elastic-run, /opt/trellis/bin/trellis-entrypoint
#   /opt/trellis/libexec/{hybrid_training,parameter_server}
#   /opt/trellis/lib/   Trellis's own shared libraries (from BUILD_DIR)
#   /usr/lib/...        every other shared library the binaries load (the
#                       dynamic loader, libc, libstdc++, libtorch and its
#                       dependencies, OpenBLAS, ...) at their real paths,
#                       with Debian's merged-/usr links (/lib -> usr/lib,
#                       /lib64 -> usr/lib64)
#   /bin/sh             dash (for the entrypoint and the k8s liveness probe)
#   /etc                passwd, group, nsswitch.conf, hosts, ld.so.conf and
#                       an ld.so.cache made by `ldconfig -r`
#   /tmp, /var/tmp      mode 1777; /ckpt for checkpoints (a volume in k8s)
#
#   deploy/container/assemble-rootfs.sh BUILD_DIR ROOTFS_DIR
#
# ROOTFS_DIR must not exist or be empty. No compilers, no headers.
set -euo pipefail

if (($# != 2)); then
  echo "usage: $0 BUILD_DIR ROOTFS_DIR" >&2
  exit 2
fi
build=$(realpath "$1")
root=$2
src=$(realpath "$(dirname "$0")/../..")
for tool in ldd ldconfig readelf; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "assemble-rootfs: $tool not found" >&2
    exit 2
  fi
done
if [[ -e $root ]] && [[ -n $(ls -A "$root") ]]; then
  echo "assemble-rootfs: $root is not empty" >&2
  exit 2
fi

declare -A bins=(
  [bin/elastic-run]=$build/elastic/elastic-run
  [libexec/hybrid_training]=$build/examples/hybrid_training
  [libexec/parameter_server]=$build/examples/parameter_server
)
for dest in "${!bins[@]}"; do
  if [[ ! -x ${bins[$dest]} ]]; then
    echo "assemble-rootfs: ${bins[$dest]} is missing; build it first:" \
      "cmake --build $build --target elastic-run hybrid_training parameter_server" >&2
    exit 2
  fi
done

mkdir -p "$root"/opt/trellis/{bin,libexec,lib} "$root"/etc "$root"/usr "$root"/tmp "$root"/proc \
  "$root"/sys "$root"/dev "$root"/run "$root"/var/tmp "$root"/root "$root"/ckpt
chmod 1777 "$root"/tmp "$root"/var/tmp

# Debian 12 is merged-/usr: keep the same top-level links so that the
# loader path in every binary (PT_INTERP /lib64/ld-linux-x86-64.so.2) and
# the paths in ld.so.cache resolve as on the host.
for d in bin sbin lib lib64 libx32 lib32; do
  if [[ -L /$d ]]; then
    ln -s "$(readlink "/$d")" "$root/$d"
    mkdir -p "$root/$(dirname "/$d")/$(readlink "/$d")"
  fi
done

# Copies FILE (following links) to the real directory it lives in on the
# host, under the name it was asked by (the soname), so the loader finds it
# by that name.
declare -A libdirs=()
copy_lib() {
  local path=$1 dir
  dir=$(realpath "$(dirname "$path")")
  libdirs[$dir]=1
  mkdir -p "$root$dir"
  [[ -e $root$dir/$(basename "$path") ]] || cp -L "$path" "$root$dir/$(basename "$path")"
}

# The ldd closure of every binary (ldd already lists indirect dependencies).
declare -A libs=()
for dest in "${!bins[@]}"; do
  bin=${bins[$dest]}
  cp -L "$bin" "$root/opt/trellis/$dest"
  out=$(ldd "$bin") || { echo "assemble-rootfs: ldd $bin failed: $out" >&2; exit 1; }
  if grep -q "not found" <<<"$out"; then
    echo "assemble-rootfs: $bin has unresolved libraries:" >&2
    grep "not found" <<<"$out" >&2
    exit 1
  fi
  while read -r lib; do
    libs[$lib]=1
  done < <(grep -o '/[^ ]*' <<<"$out")
done
# The shell for the entrypoint and the liveness probe (dash: libc only),
# at /usr/bin/sh with /bin -> usr/bin also where the host is not merged.
mkdir -p "$root/usr/bin"
[[ -e $root/bin ]] || ln -s usr/bin "$root/bin"
cp -L /bin/sh "$root/usr/bin/sh"
while read -r lib; do libs[$lib]=1; done < <(ldd /bin/sh | grep -o '/[^ ]*')

for lib in "${!libs[@]}"; do
  case $(realpath "$lib") in
    "$build"/* | "$src"/*) cp -L "$lib" "$root/opt/trellis/lib/$(basename "$lib")" ;;
    *) copy_lib "$lib" ;;
  esac
done
# The loader by its PT_INTERP path, in case ldd listed it by another name.
interp=$(readelf -l "${bins[bin/elastic-run]}" 2>/dev/null | sed -n 's/.*interpreter: \(.*\)]/\1/p' || true)
[[ -n $interp && -e $interp ]] && copy_lib "$interp"

# Trellis's own files without their debug info (a RelWithDebInfo build's
# is most of their size); the system libraries are Debian's, already
# stripped.
if command -v strip >/dev/null 2>&1; then
  find "$root/opt/trellis" -type f \( -name '*.so*' -o -perm -u+x \) -exec strip --strip-debug {} +
fi

cat >"$root/etc/ld.so.conf" <<EOF
/opt/trellis/lib
$(printf '%s\n' "${!libdirs[@]}" | sort)
EOF
ldconfig -r "$root" -f /etc/ld.so.conf -C /etc/ld.so.cache

cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
trellis:x:1000:1000:trellis:/tmp:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
trellis:x:1000:
nogroup:x:65534:
EOF
cat >"$root/etc/nsswitch.conf" <<'EOF'
passwd: files
group:  files
hosts:  files dns
EOF
cat >"$root/etc/hosts" <<'EOF'
127.0.0.1 localhost
::1       localhost ip6-localhost ip6-loopback
EOF
install -m 0755 "$src/deploy/container/trellis-entrypoint" "$root/opt/trellis/bin/trellis-entrypoint"
echo "$(git -C "$src" describe --always --dirty 2>/dev/null || echo unknown)" >"$root/opt/trellis/VERSION"

echo "assemble-rootfs: $root: $(du -sm "$root" | cut -f1) MiB, ${#libs[@]} shared libraries"
