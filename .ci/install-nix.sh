#!/usr/bin/env bash
# Nix >= 2.18 for the Nix checks on a Debian machine without one: unpacks Debian trixie's nix-bin
# (2.26) and its shared libraries into PREFIX with `apt-get download` only (the system's apt state
# and libc stay untouched) and writes wrappers in PREFIX/bin with flakes enabled. bookworm's own
# nix-bin (2.8) is too old for current nixpkgs' lib.
#
# usage: .ci/install-nix.sh [PREFIX]      (default ~/.cache/kiln-ci/nix; prints PREFIX/bin)
set -euo pipefail
PREFIX=${1:-${KILN_CI_CACHE:-$HOME/.cache/kiln-ci}/nix}
if [ -x "$PREFIX/bin/nix" ] && "$PREFIX/bin/nix" --version >/dev/null 2>&1; then
  echo "$PREFIX/bin"; exit 0
fi
# A Nix of its own (NixOS, a Nix install) that is new enough serves as it is.
if command -v nix >/dev/null 2>&1; then
  have=$(nix --version 2>/dev/null | grep -o -E '[0-9]+\.[0-9]+' | head -n1 || true)
  if [ -n "$have" ] && [ "$(printf '%s\n2.18\n' "$have" | sort -V | head -n1)" = 2.18 ]; then
    mkdir -p "$PREFIX/bin"
    for prog in nix nix-instantiate nix-build nix-store nix-hash nix-env; do
      command -v "$prog" >/dev/null || continue
      printf '#!/bin/sh\nexec %s --extra-experimental-features "nix-command flakes" "$@"\n' \
        "$(command -v "$prog")" > "$PREFIX/bin/$prog"
      chmod +x "$PREFIX/bin/$prog"
    done
    echo "$PREFIX/bin"; exit 0
  fi
fi
command -v apt-get >/dev/null || { echo "install-nix: no Nix >= 2.18 and no apt-get to fetch one" >&2; exit 1; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/lists/partial" "$W/cache/archives/partial" "$W/debs" "$PREFIX/root" "$PREFIX/bin"
MIRROR=$(grep -h -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | head -n1 || true)
[ -n "$MIRROR" ] || MIRROR=$(grep -h -m1 -E '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' || true)
[ -n "$MIRROR" ] || { echo "install-nix: no Debian mirror in the apt sources" >&2; exit 1; }
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main" > "$W/sources.list"
: > "$W/status"
A=(-o Dir::Etc::SourceList="$W/sources.list" -o Dir::Etc::SourceParts=/dev/null
   -o Dir::State::Lists="$W/lists" -o Dir::Cache="$W/cache" -o Dir::State::status="$W/status"
   -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root)
apt-get "${A[@]}" -qq update
# nix-bin's dependency closure, shared libraries only (no perl, pam, debconf ...).
mapfile -t PKGS < <(apt-cache "${A[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends nix-bin \
  | grep -v '^ ' | grep -v '^<' | sort -u \
  | grep -E '^(nix-bin|lib|gcc-14-base|openssl-provider-legacy)' \
  | grep -v -E 'perl|libpam|libsemanage|libdebian-installer|libdebconf|libnewt|libslang|libtextwrap|libaudit|libcap-ng|libselinux|libsepol')
( cd "$W/debs" && apt-get "${A[@]}" -qq download "${PKGS[@]}" )
for f in "$W"/debs/*.deb; do dpkg-deb -x "$f" "$PREFIX/root"; done
R="$PREFIX/root"
for prog in nix nix-instantiate nix-build nix-store nix-hash nix-env; do
  cat > "$PREFIX/bin/$prog" <<WRAP
#!/bin/sh
export NIX_CONFIG="\${NIX_CONFIG:+\$NIX_CONFIG
}extra-experimental-features = nix-command flakes
build-users-group ="
exec "$R/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$R/usr/lib/x86_64-linux-gnu" --argv0 $prog "$R/usr/bin/nix" "\$@"
WRAP
  chmod +x "$PREFIX/bin/$prog"
done
"$PREFIX/bin/nix" --version >&2
echo "$PREFIX/bin"
